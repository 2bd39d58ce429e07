from pathlib import Path


def test_top_word():
    assert Path("/app/top_word.txt").read_text().strip() == "the"
