from pathlib import Path


def test_error_counts():
    lines = Path("/app/errors.csv").read_text().split()
    assert lines == ["api,1", "auth,1", "db,2"]
