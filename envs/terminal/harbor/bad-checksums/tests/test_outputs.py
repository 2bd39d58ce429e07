from pathlib import Path


def test_bad_files():
    assert Path("/app/bad.txt").read_text().split() == ["b.dat", "d.dat"]
