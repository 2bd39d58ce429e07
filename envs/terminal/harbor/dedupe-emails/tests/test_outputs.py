from pathlib import Path


def test_unique_sorted_lowercase():
    assert Path("/app/unique.txt").read_text().split() == [
        "ann@example.com",
        "bob@example.com",
        "carl@example.com",
    ]
