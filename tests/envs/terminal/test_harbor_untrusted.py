"""Harbor task folders are untrusted input (issue 41, item 5): a symbolic link that leaves the
task folder, directly, to a directory or through a chain, and a timeout of task.toml that is
infinite, not a number, negative or huge are each refused with an error naming the problem;
links that stay inside the folder and a good task still load."""

import os

import pytest

from envs.terminal.env import load_task_set
from envs.terminal.harbor import MAX_TIMEOUT_SEC, load_harbor_task
from tests.envs.terminal.test_harbor import harbor_folder


@pytest.fixture
def secret(tmp_path):
    """A file and a folder of the host, outside any task folder."""
    outside = tmp_path / "host"
    (outside / "keys").mkdir(parents=True)
    (outside / "secret.txt").write_text("the trainer's API key\n")
    (outside / "keys" / "id_rsa").write_text("private\n")
    return outside


def test_a_good_task_and_links_inside_it_load(tmp_path):
    task = harbor_folder(tmp_path / "set")
    os.symlink("test.sh", task / "tests" / "again.sh")
    os.symlink("../tests", task / "environment" / "tests")
    loaded = load_harbor_task(task)
    assert dict(loaded.tests)["again.sh"] == dict(loaded.tests)["test.sh"]
    assert list(load_task_set(f"harbor:{tmp_path / 'set'}", "all")) == ["harbor/hello"]


def test_a_link_to_a_file_outside_is_refused(tmp_path, secret):
    task = harbor_folder(tmp_path / "set")
    os.symlink(secret / "secret.txt", task / "tests" / "data.txt")
    with pytest.raises(ValueError, match=r"tests/data.txt is a symbolic link to .*secret.txt"):
        load_harbor_task(task)


def test_a_link_replacing_a_required_file_is_refused(tmp_path, secret):
    task = harbor_folder(tmp_path / "set")
    (task / "instruction.md").unlink()
    os.symlink(secret / "secret.txt", task / "instruction.md")
    with pytest.raises(ValueError, match="instruction.md is a symbolic link .* leaves the task"):
        load_harbor_task(task)


def test_a_link_to_a_directory_outside_is_refused(tmp_path, secret):
    task = harbor_folder(tmp_path / "set")
    os.symlink(secret / "keys", task / "environment" / "keys")
    with pytest.raises(ValueError, match="environment/keys is a symbolic link"):
        load_harbor_task(task)


def test_a_chain_of_links_that_ends_outside_is_refused(tmp_path, secret):
    task = harbor_folder(tmp_path / "set")
    os.symlink(secret / "secret.txt", tmp_path / "set" / "hop")  # beside the task, not in it
    os.symlink("../../hop", task / "solution" / "step")
    os.symlink("step", task / "solution" / "notes.md")  # inside, to a link that leaves
    with pytest.raises(ValueError, match=r"solution/(notes.md|step) is a symbolic link"):
        load_harbor_task(task)


def test_a_loop_of_links_and_a_linked_task_folder_are_refused(tmp_path, secret):
    task = harbor_folder(tmp_path / "set")
    os.symlink("b", task / "tests" / "a")
    os.symlink("a", task / "tests" / "b")
    with pytest.raises(ValueError, match="tests/[ab] is a symbolic link"):
        load_harbor_task(task)
    other = harbor_folder(tmp_path / "elsewhere", name="real")
    os.symlink(other, tmp_path / "linked")
    with pytest.raises(ValueError, match="is a symbolic link; a task folder must be a folder"):
        load_harbor_task(tmp_path / "linked")


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "-1", "0", "1e12", "true", "86401"])
@pytest.mark.parametrize(
    ("section", "key"),
    [("agent", "timeout_sec"), ("verifier", "timeout_sec"), ("environment", "build_timeout_sec")],
)
def test_a_timeout_that_is_not_finite_and_bounded_is_refused(tmp_path, section, key, value):
    task = harbor_folder(tmp_path)
    (task / "task.toml").write_text(f"[{section}]\n{key} = {value}\n")
    bound = f"at most {MAX_TIMEOUT_SEC:g}"
    with pytest.raises(ValueError, match=rf"\[{section}\] {key} must be .*{bound}; got"):
        load_harbor_task(task)


def test_timeouts_within_the_bounds_load(tmp_path):
    task = harbor_folder(tmp_path)
    (task / "task.toml").write_text(
        "[agent]\ntimeout_sec = 0.5\n[verifier]\ntimeout_sec = 86400\n"
        "[environment]\nbuild_timeout_sec = 1200.0\n"
    )
    loaded = load_harbor_task(task)
    assert (loaded.command_timeout, loaded.test_timeout) == (0.5, 86400.0)
