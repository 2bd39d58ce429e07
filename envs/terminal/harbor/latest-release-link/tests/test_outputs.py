import os


def test_is_link_to_highest():
    assert os.path.islink("/app/latest")
    assert os.path.realpath("/app/latest") == "/app/releases/v10"
