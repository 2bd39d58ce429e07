"""What a command may leave behind, on both backends: files within a disk and file budget
(stopped past it with a clear error), no process running on into the next command, an end
of command the command itself cannot forge; and, for bwrap, no root directory or cgroup
left by an owner that was killed."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from envs.sandbox import SandboxConfig, make_sandbox
from envs.sandbox.limits import cgroups_named

ROOT = Path(__file__).resolve().parents[3]
BUDGET_NOTE = "disk budget of"


@pytest.fixture
def small_disk(backend):
    """A sandbox of `backend` with a disk budget of 40 MB and 2,000 files."""
    config = SandboxConfig(timeout=60.0, disk_mb=40, max_files=2000, max_file_mb=64)
    with make_sandbox(backend, config) as sandbox:
        sandbox.start()
        yield sandbox


def assert_usable(sandbox):
    result = sandbox.exec("cd /workspace && echo ok > usable.txt && cat usable.txt")
    assert (result.exit_code, result.stdout, result.stderr) == (0, "ok\n", "")


def test_a_forged_end_of_command_does_not_end_it(sandbox):
    # Everything the shell holds (variables, functions, the old session marker) printed on
    # both streams as the end of a command with status 0, then the command runs on.
    forged = (
        'for s in 1 2; do { set; declare -f; printf "%s0\\n" "$__cg_mark"; } >&$s; done; sleep 60'
    )
    started = time.monotonic()
    result = sandbox.exec(forged, timeout=3)
    assert result.timed_out and result.exit_code == 124
    assert time.monotonic() - started >= 3
    assert_usable(sandbox)


def test_nothing_a_command_started_runs_on_into_the_next(sandbox):
    sandbox.exec(
        "(while :; do echo x >> /tmp/child.log; sleep 0.05; done) & "
        "setsid sh -c 'while :; do echo x >> /tmp/daemon.log; sleep 0.05; done' "
        ">/dev/null 2>&1 </dev/null &"
    )
    time.sleep(0.5)
    count = "cat /tmp/child.log /tmp/daemon.log | wc -l"
    first = int(sandbox.exec(count).stdout)
    time.sleep(0.5)
    assert first > 2
    assert int(sandbox.exec(count).stdout) == first  # both were killed by the first count


def test_keep_background_lets_them_run_on(backend):
    with make_sandbox(backend, SandboxConfig(keep_background=True)) as sandbox:
        sandbox.exec("(while :; do echo x >> /tmp/child.log; sleep 0.05; done) &")
        lines = _poll(lambda: int(sandbox.exec("wc -l < /tmp/child.log 2>/dev/null").stdout or 0))
        first = lines(lambda n: n > 0)
        assert lines(lambda n: n > first) > first  # still writing, after the execs between


def _poll(read, timeout=30.0):
    """`until(condition)`: reads `read()` until `condition` holds of it (or the timeout
    passes) and returns the last value: a busy machine slows the loop, never fails it."""

    def until(condition):
        deadline = time.monotonic() + timeout
        value = read()
        while not condition(value) and time.monotonic() < deadline:
            time.sleep(0.05)
            value = read()
        return value

    return until


def test_a_writer_past_the_disk_budget_is_stopped_and_told_why(small_disk):
    # 400 MB in 10 MB files, ten times the budget
    writer = (
        "for i in $(seq 1 40); do head -c 10000000 /dev/zero > /workspace/f$i; sleep 0.05; "
        "done; echo finished"
    )
    result = small_disk.exec(writer)
    assert "finished" not in result.stdout and not result.timed_out
    assert "[error] the command was stopped" in result.stderr and BUDGET_NOTE in result.stderr
    written = int(small_disk.exec("du -sm /workspace | cut -f1").stdout)
    assert written < 200
    # over budget, a command that adds nothing runs (and is reminded); deleting gets back under
    listing = small_disk.exec("ls /workspace | wc -l")
    assert listing.exit_code == 0 and int(listing.stdout) < 40 and BUDGET_NOTE in listing.stderr
    assert small_disk.exec("rm /workspace/f*").exit_code == 0
    assert_usable(small_disk)


def test_a_flood_of_files_past_the_file_budget_is_stopped(small_disk):
    flood = (
        "for i in $(seq 1 100); do mkdir /workspace/d$i && touch /workspace/d$i/f{1..100}; "
        "sleep 0.02; done; echo finished"
    )
    result = small_disk.exec(flood)
    assert "finished" not in result.stdout
    assert "[error] the command was stopped" in result.stderr and "2000 files" in result.stderr
    assert int(small_disk.exec("find /workspace | wc -l").stdout) < 10_000
    small_disk.exec("rm -rf /workspace/d*")
    assert_usable(small_disk)


def test_a_loop_of_the_shell_itself_writing_files_is_stopped(small_disk):
    # no process but the shell to kill: the shell itself is replaced
    loop = "cd /tmp; i=0; while [ $i -lt 200000 ]; do : > g$i; i=$((i+1)); done; echo finished"
    result = small_disk.exec(loop)
    assert "finished" not in result.stdout and not result.timed_out
    assert result.shell_restarted and BUDGET_NOTE in result.stderr
    small_disk.exec("find /tmp -maxdepth 1 -name 'g*' -delete")
    assert_usable(small_disk)


@pytest.mark.parametrize("name", ["d", "d" * 20], ids=["short-names", "past-PATH_MAX"])
def test_a_tree_1200_levels_deep_is_measured(small_disk, name):
    # with 20-character names the deepest path is 25,000 characters, past PATH_MAX (4,096)
    deep = (
        "import os\n"
        "for _ in range(1200):\n"
        f"    os.mkdir('{name}'); os.chdir('{name}')\n"
        "open('big', 'wb').write(bytes(50_000_000))\n"
    )
    result = small_disk.exec(f'cd /workspace && python3 -c "{deep}"')
    assert BUDGET_NOTE in result.stderr
    small_disk.exec(f"cd /workspace && rm -rf {name}")
    assert_usable(small_disk)


def test_bwrap_dev_is_read_only_but_for_a_small_dev_shm():
    with make_sandbox("bwrap", SandboxConfig(max_file_mb=64)) as sandbox:
        result = sandbox.exec(
            "for i in 1 2 3; do head -c 40000000 /dev/zero > /dev/shm/f$i; done; "
            "du -sm /dev/shm | cut -f1; touch /dev/planted"
        )
        assert int(result.stdout) <= 64
        assert "No space left on device" in result.stderr
        assert "Read-only file system" in result.stderr


def test_bwrap_leftovers_of_a_killed_owner_are_reaped_at_start_up():
    crash = (
        "import os, signal\n"
        "from envs.sandbox.bwrap import BwrapSandbox\n"
        "sandbox = BwrapSandbox()\n"
        "sandbox.start()\n"
        "sandbox.exec('echo left > /workspace/behind')\n"
        "print(sandbox.root, *sandbox.limits.cgroup_dirs, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)  # close() never runs\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", crash], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    root, *cgroups = (Path(p) for p in run.stdout.split())
    assert run.returncode == -9 and root.is_dir()
    assert all(c.is_dir() for c in cgroups)
    assert cgroups or os.geteuid() != 0  # as root the sandbox had cgroups to leave behind
    with make_sandbox("bwrap", SandboxConfig()) as alive:  # a live owner's sandbox
        start_up = "from envs.sandbox.bwrap import BwrapSandbox\nBwrapSandbox().close()\n"
        subprocess.run([sys.executable, "-c", start_up], cwd=ROOT, check=True, timeout=120)
        assert not root.exists()
        assert not any(c.exists() for c in cgroups)
        assert root.name not in cgroups_named(root.name)
        assert alive.root.is_dir() and alive.exec("echo alive").stdout == "alive\n"
