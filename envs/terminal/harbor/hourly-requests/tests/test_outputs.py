from pathlib import Path


def test_hourly_counts():
    assert Path("/app/hourly.txt").read_text().splitlines() == ["09 2", "10 1", "13 3"]
