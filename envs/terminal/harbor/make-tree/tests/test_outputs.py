import os


def test_directories_exist():
    for path in ("a/b/c", "a/d", "e", "f/g h"):
        assert os.path.isdir(os.path.join("/app/out", path))
