from pathlib import Path


def test_sorted_descending():
    assert Path("/app/sorted.txt").read_text().split() == ["250", "99", "10", "7", "0", "-3"]
