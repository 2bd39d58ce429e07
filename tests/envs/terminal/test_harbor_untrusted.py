"""Harbor task folders are untrusted input (issue 41, item 5): a symbolic link that leaves the
task folder, directly, to a directory or through a chain, and a timeout of task.toml that is
infinite, not a number, negative or huge are each refused with an error naming the problem;
links that stay inside the folder and a good task still load. Terminal-bench task folders
and the converter from them get the same checks, and a Harbor folder is checked again right
before its Docker build context is made."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from envs.terminal.env import load_task_set
from envs.terminal.harbor import _context_archive, build_image, load_harbor_task
from envs.terminal.tasks import MAX_TIMEOUT_SEC, SHIPPED, load_tbench_task
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


def tbench_folder(root: Path, name: str = "count-lines") -> Path:
    """A copy of a shipped terminal-bench task folder under `root`."""
    return Path(shutil.copytree(SHIPPED / name, root / name))


def test_a_terminal_bench_folder_gets_the_same_checks(tmp_path, secret):
    task = tbench_folder(tmp_path / "set")
    assert load_tbench_task(task).task_id == "tbench/count-lines"  # a good one loads
    os.symlink(secret / "secret.txt", task / "tests" / "fixture.txt")
    with pytest.raises(ValueError, match=r"terminal-bench task .*tests/fixture.txt is a symbolic"):
        load_tbench_task(task)
    with pytest.raises(ValueError, match="leaves the task folder"):
        load_task_set(str(tmp_path / "set"), "all")
    (task / "tests" / "fixture.txt").unlink()
    meta = (task / "task.yaml").read_text()
    for field, value in (("max_test_timeout_sec", ".inf"), ("max_agent_timeout_sec", ".nan")):
        (task / "task.yaml").write_text(f"{meta}\n{field}: {value}\n")
        with pytest.raises(ValueError, match=rf"{field} must be .*at most"):
            load_tbench_task(task)


def test_the_converter_refuses_a_folder_with_a_link_that_leaves_it(tmp_path, secret):
    """`python -m envs.terminal.harbor SOURCE TARGET`, run as a user runs it: it ends with the
    reason, and the secret is nowhere in what it wrote."""
    source, target = tmp_path / "tbench", tmp_path / "harbor"
    task = tbench_folder(source)
    os.symlink(secret / "keys", task / "tests" / "keys")
    command = [sys.executable, "-m", "envs.terminal.harbor", str(source), str(target)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "tests/keys is a symbolic link" in done.stderr and "Traceback" not in done.stderr
    assert not (target / "count-lines").exists()
    (task / "tests" / "keys").unlink()
    assert subprocess.run(command, capture_output=True, timeout=120).returncode == 0
    assert (target / "count-lines" / "task.toml").is_file()


def test_a_link_made_after_loading_is_refused_before_the_build(tmp_path, secret):
    """The folder is checked again right before its build context is made (no Docker
    daemon is reached: the refusal comes first), and each file read into the context is
    checked as it is read."""
    task = load_harbor_task(harbor_folder(tmp_path / "set"))
    context = tmp_path / "set" / "hello" / "environment"
    os.symlink(secret / "secret.txt", context / "later.txt")
    with pytest.raises(ValueError, match="environment/later.txt is a symbolic link"):
        build_image(task.environment)
    with pytest.raises(ValueError, match="environment/later.txt leads out of the task folder"):
        _context_archive(context)
