import subprocess


def git(*args):
    return subprocess.run(["git", "-C", "/app/repo", *args], capture_output=True, text=True)


def test_one_commit_with_message():
    log = git("log", "--format=%s")
    assert log.returncode == 0 and log.stdout.split("\n")[:1] == ["initial import"]
    assert len(log.stdout.strip().splitlines()) == 1


def test_files_committed():
    assert sorted(git("ls-files").stdout.split()) == ["hello.txt", "world.txt"]
