import tarfile


def names():
    with tarfile.open("/app/project.tar.gz", "r:gz") as tar:
        return {m.name.rstrip("/") for m in tar.getmembers() if m.isfile()}


def test_sources_kept():
    assert {"project/src/main.py", "project/README"} <= names()


def test_logs_left_out():
    assert not any(n.endswith(".log") for n in names())
