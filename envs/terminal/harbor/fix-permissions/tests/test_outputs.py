import os
import stat


def test_secret_mode():
    assert stat.S_IMODE(os.stat("/app/secret.txt").st_mode) == 0o600


def test_run_executable_by_all():
    mode = os.stat("/app/bin/run").st_mode
    assert mode & stat.S_IXUSR and mode & stat.S_IXGRP and mode & stat.S_IXOTH
