import os
import subprocess


def run(env):
    return subprocess.run(
        ["/app/show_env.sh"], capture_output=True, text=True, env=env
    ).stdout.strip()


def test_set():
    assert run({"PATH": os.environ["PATH"], "APP_MODE": "prod"}) == "prod"


def test_unset():
    assert run({"PATH": os.environ["PATH"]}) == "unset"
