import os
import subprocess


def test_executable():
    assert os.access("/app/greet.sh", os.X_OK)


def test_with_name():
    assert (
        subprocess.run(["/app/greet.sh", "Ada"], capture_output=True, text=True).stdout
        == "Hello, Ada!\n"
    )


def test_without_name():
    assert (
        subprocess.run(["/app/greet.sh"], capture_output=True, text=True).stdout
        == "Hello, world!\n"
    )
