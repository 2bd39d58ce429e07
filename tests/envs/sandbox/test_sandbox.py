"""The sandbox interface on both backends: the persistent shell, timeouts, the output cap,
files, and close."""

import threading
import time

import pytest

from envs.sandbox import (
    SandboxClosed,
    SandboxConfig,
    SandboxError,
    SandboxPool,
    closed_on_failure,
    make_sandbox,
    resolve_backend,
)
from envs.sandbox.docker import docker_answers
from envs.sandbox.output import CappedBuffer


def test_directory_and_exports_persist_between_commands(sandbox):
    assert (
        sandbox.exec("mkdir -p /workspace/sub && cd /workspace/sub && export GREETING=hi").exit_code
        == 0
    )
    result = sandbox.exec('pwd; echo "$GREETING"; NOT_EXPORTED=1')
    assert result.stdout == "/workspace/sub\nhi\n"
    assert sandbox.exec("echo ${NOT_EXPORTED:-none}").stdout == "1\n"


def test_exit_code_stdout_and_stderr_are_separate(sandbox):
    result = sandbox.exec(
        "echo out; echo err >&2; printf tail; exit_code_of() { return 7; }; exit_code_of"
    )
    assert (result.exit_code, result.stdout, result.stderr) == (7, "out\ntail", "err\n")
    assert not result.timed_out and not result.truncated


def test_commands_never_read_the_shells_stdin(sandbox):
    result = sandbox.exec("cat; read -r line; echo read=$?", timeout=5)
    assert result.stdout == "read=1\n" and not result.timed_out


def test_syntax_errors_and_multiline_scripts(sandbox):
    assert sandbox.exec("if then fi").exit_code == 2
    script = "for i in 1 2 3; do\n  echo $i\ndone | tac\ncat <<'EOF'\n$HOME stays literal\nEOF"
    assert sandbox.exec(script).stdout == "3\n2\n1\n$HOME stays literal\n"


def test_exit_starts_a_new_shell_in_the_same_place(sandbox):
    sandbox.exec("cd /tmp && export KEEP=yes")
    result = sandbox.exec("exit 3")
    assert result.shell_restarted and result.exit_code == 3
    assert sandbox.exec('pwd; echo "$KEEP"').stdout == "/tmp\nyes\n"


def test_restart_shell_forgets_the_agents_state(sandbox):
    sandbox.exec("cd /tmp && export KEEP=yes && sleep 1001 &")
    sandbox.restart_shell()
    result = sandbox.exec('pwd; echo "${KEEP:-gone}"; pgrep -f "sleep 1001" || echo none')
    assert result.stdout == "/workspace\ngone\nnone\n"


def test_files_round_trip_and_are_visible_to_the_shell(sandbox):
    sandbox.write_file("/workspace/dir/a.txt", "hello\n")
    sandbox.write_file("/workspace/bin.dat", bytes(range(256)))
    assert sandbox.exec("cat /workspace/dir/a.txt").stdout == "hello\n"
    assert sandbox.read_file("/workspace/bin.dat") == bytes(range(256))
    sandbox.exec("echo made-inside > /workspace/inside.txt")
    assert sandbox.read_file("/workspace/inside.txt") == b"made-inside\n"
    with pytest.raises(SandboxError):
        sandbox.read_file("/workspace/missing.txt")


def test_close_is_idempotent_and_later_use_is_an_error(sandbox):
    sandbox.close()
    sandbox.close()
    assert sandbox.closed
    with pytest.raises(SandboxClosed):
        sandbox.exec("true")


def test_closed_on_failure_closes_only_a_sandbox_whose_setup_raised(sandbox):
    with closed_on_failure(sandbox) as same:
        same.write_file("/tmp/ok", "fine")
    assert same is sandbox and not sandbox.closed
    with pytest.raises(SandboxError, match="setup broke"):
        with closed_on_failure(sandbox):
            sandbox.write_file("/tmp/half", "copied")
            raise SandboxError("setup broke")
    assert sandbox.closed
    with pytest.raises(SandboxClosed):
        sandbox.exec("cat /tmp/half")


def test_close_from_another_thread_cancels_a_running_command(sandbox):
    errors = []

    def run():
        try:
            sandbox.exec("sleep 60", timeout=120)
        except SandboxError as error:
            errors.append(error)

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(0.5)
    sandbox.close()
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert errors and isinstance(errors[0], SandboxError)


def test_capped_buffer_keeps_head_and_tail_with_a_marker():
    buffer = CappedBuffer(400)
    for chunk in (b"H" * 300, b"x" * 10_000, b"T" * 100):
        buffer.add(chunk)
    value, omitted = buffer.value()
    assert value.startswith(b"H" * 300) and value.endswith(b"T" * 100)
    assert f"[... {omitted} bytes of output omitted ...]".encode() in value
    assert omitted == 300 + 10_000 + 100 - 400


@pytest.mark.parametrize(
    "kwargs",
    [
        {"workdir": "relative"},
        {"writable": ("/tmp",)},
        {"timeout": 0},
        {"max_procs": -1},
        {"writable": ("/a/../etc",)},
    ],
)
def test_bad_configs_are_refused_with_the_fix(kwargs):
    with pytest.raises(ValueError):
        SandboxConfig(**kwargs)


def test_auto_means_docker_exactly_when_a_daemon_answers():
    assert resolve_backend("auto") == ("docker" if docker_answers() else "bwrap")
    with pytest.raises(ValueError, match="unknown sandbox"):
        make_sandbox("vm")


def test_a_pool_hands_out_started_sandboxes_and_closes_its_spares(backend):
    pool = SandboxPool(backend, SandboxConfig(), size=2)
    deadline = time.monotonic() + 60
    while pool.ready() < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.ready() == 2
    first, second = pool.take(), pool.take()
    try:
        assert first is not second
        first.exec("echo mine > /workspace/f")
        assert second.exec("cat /workspace/f 2>&1; echo $?").stdout.endswith("1\n")
    finally:
        first.close()
        second.close()
    while pool.ready() < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    spares = list(pool._spares)
    pool.close()
    assert spares and all(s.closed for s in spares)
    with pytest.raises(ValueError, match="closed"):
        pool.take()


def test_a_sandbox_outlives_the_thread_that_started_it(backend):
    made = []

    def start():
        sandbox = make_sandbox(backend, SandboxConfig())
        sandbox.start()
        made.append(sandbox)

    worker = threading.Thread(target=start)
    worker.start()
    worker.join()
    time.sleep(0.2)
    try:
        assert made[0].exec("echo alive").stdout == "alive\n"
    finally:
        made[0].close()
