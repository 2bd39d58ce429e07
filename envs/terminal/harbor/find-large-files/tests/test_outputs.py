from pathlib import Path


def test_large_files():
    assert Path("/app/large.txt").read_text().split() == ["a/b/deep.bin", "big.bin"]
