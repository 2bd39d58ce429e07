from pathlib import Path


def test_active_users_sorted():
    assert Path("/app/active.txt").read_text().split() == ["bob", "mia", "zoe"]
