"""The containment battery, on both backends: each attack is contained, the agent gets a
clear error, the sandbox takes the next command, and the host is unchanged. Network tests
target a registry by name and a loopback server this test starts; nothing else."""

import os
import secrets
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from envs.sandbox import SandboxConfig, SandboxError, make_sandbox
from envs.sandbox.limits import refused_forks

ROOT = Path(__file__).resolve().parents[3]


def assert_usable(sandbox):
    result = sandbox.exec("cd /workspace && echo ok > usable.txt && cat usable.txt", timeout=30)
    assert (result.exit_code, result.stdout) == (0, "ok\n")


@pytest.fixture
def loopback_server():
    """A TCP server on the host's 127.0.0.1 that records every connection it accepts."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    accepted = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            accepted.append(conn)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


@pytest.fixture
def host_secrets():
    """Files with a secret token in the home directory and in the project's runs/ (where
    stores live); removed afterwards."""
    token = secrets.token_hex(16)
    paths = [
        Path.home() / f".clawgym-secret-{token[:8]}",
        ROOT / "runs" / f"secret-{token[:8]}" / "store.sqlite",
    ]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(token)
    yield token, paths
    for path in paths:
        path.unlink()
    paths[1].parent.rmdir()


def test_no_network_egress_to_a_registry(sandbox):
    script = (
        "import socket\n"
        "try:\n"
        "    socket.create_connection(('pypi.org', 443), timeout=5)\n"
        "    print('CONNECTED')\n"
        "except OSError as error:\n"
        "    print('refused:', error)\n"
    )
    result = sandbox.exec(f'python3 -c "{script}"', timeout=30)
    assert "refused:" in result.stdout and "CONNECTED" not in result.stdout
    assert_usable(sandbox)


def test_host_loopback_services_are_unreachable(sandbox, loopback_server):
    port, accepted = loopback_server
    result = sandbox.exec(
        f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)\"",
        timeout=30,
    )
    assert result.exit_code != 0 and "ConnectionRefusedError" in result.stderr
    assert accepted == []
    assert_usable(sandbox)


def test_writes_outside_the_workspace_never_reach_the_host(sandbox, backend):
    probe = f"clawgym-probe-{secrets.token_hex(4)}"
    targets = [f"/etc/{probe}", f"/usr/{probe}", f"/{probe}", f"{Path.home()}/{probe}"]
    result = sandbox.exec("; ".join(f"echo x > {t}" for t in targets) + f"; echo x > /tmp/{probe}")
    for target in targets:
        assert not Path(target).exists()
    if backend == "bwrap":  # a read-only system: every write outside the workspace fails
        assert (
            result.stderr.count("Read-only file system") + result.stderr.count("No such file") == 4
        )
    assert_usable(sandbox)


def test_host_files_outside_the_mounts_cannot_be_read(sandbox, host_secrets):
    token, paths = host_secrets
    result = sandbox.exec(
        "; ".join(f"cat {p}" for p in paths)
        + f"; grep -rs {token} /root /home /work /var 2>/dev/null",
        timeout=60,
    )
    assert token not in result.stdout + result.stderr
    assert result.stderr.count("No such file or directory") == len(paths)
    assert_usable(sandbox)


def test_a_fork_bomb_is_contained(sandbox):
    # the command waits up to 15 s for the bomb to fill the sandbox (seconds on a loaded
    # machine): the next command would kill a bomb that has not, as any leftover. Each of
    # its processes forks again for as long as it lives, so it stays at the limit: the
    # classic `:(){ :|:& };:` forks once and, once forks fail, can die out before the end
    # (seen on a slow machine: nothing left to report, and the test failed).
    bomb = sandbox.exec("b(){ while :; do b & done; }; b & sleep 15", timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not bomb.timed_out:
        if "[error] the sandbox reached its limit" in bomb.stderr:
            break
        time.sleep(0.5)
        bomb = sandbox.exec("true", timeout=20)
    assert "[error] the sandbox reached its limit" in bomb.stderr or bomb.timed_out
    assert subprocess.run(["true"]).returncode == 0  # the host still forks
    assert_usable(sandbox)


@pytest.mark.parametrize(
    ("events", "refused"), [("max 0\n", 0), ("max 17\n", 17), ("", None), (None, None)]
)
def test_refused_forks_reads_the_max_line_of_pids_events(tmp_path, events, refused):
    if events is not None:
        (tmp_path / "pids.events").write_text(events)
    assert refused_forks(tmp_path) == refused


# Forks until the kernel refuses one, then kills and reaps every child it made.
FORK_TO_THE_LIMIT_AND_CLEAN_UP = (
    "perl -e 'my @kids; while (defined(my $pid = fork)) { if (!$pid) { sleep 60; exit } "
    "push @kids, $pid } kill 9, @kids; waitpid $_, 0 for @kids; print scalar @kids'"
)


def test_the_limit_reached_is_reported_though_the_processes_are_gone_by_the_end(sandbox):
    # At the command's end the sandbox is far below its limit: only the kernel's count of
    # refused forks (the pids cgroup's events) tells that it was reached. A bomb whose
    # processes give up at the limit is caught the same way when it ebbs at the wrong time.
    if sandbox._process_limit_hits() is None:
        pytest.skip("this sandbox has no pids cgroup to count refused forks")
    result = sandbox.exec(FORK_TO_THE_LIMIT_AND_CLEAN_UP, timeout=30)
    assert 100 < int(result.stdout) < 128  # the kernel stopped it at the limit
    assert "[error] the sandbox reached its limit of 128 processes" in result.stderr
    assert "[error]" not in sandbox.exec("true").stderr  # reported once
    assert_usable(sandbox)


def test_a_memory_bomb_is_contained(sandbox):
    result = sandbox.exec(
        'python3 -c "chunks = []\nwhile True: chunks.append(bytearray(32 * 1024 * 1024))"',
        timeout=60,
    )
    assert result.exit_code != 0 and not result.timed_out
    assert "MemoryError" in result.stderr or result.exit_code == 137
    assert_usable(sandbox)


@pytest.mark.parametrize("spin", ["python3 -c 'while True: pass'", "while :; do :; done"])
def test_a_cpu_spin_is_killed_at_the_timeout(sandbox, spin):
    sandbox.exec("cd /tmp && export KEPT=1")
    result = sandbox.exec(spin, timeout=2)
    assert result.timed_out and result.exit_code == 124
    assert sandbox.exec('pwd; echo "$KEPT"').stdout == "/tmp\n1\n"
    assert_usable(sandbox)


def test_a_100mb_output_flood_is_capped_visibly(sandbox):
    result = sandbox.exec("head -c 100000000 /dev/zero | tr '\\0' y", timeout=120)
    assert result.exit_code == 0 and result.truncated
    assert result.stdout_omitted > 99_000_000
    assert "bytes of output omitted" in result.stdout
    assert len(result.stdout) < 9000
    assert_usable(sandbox)


def test_a_disk_filler_stops_at_the_file_size_limit(sandbox):
    result = sandbox.exec("head -c 100000000 /dev/zero > /workspace/big; echo status=$?")
    assert "status=153" in result.stdout  # 128 + SIGXFSZ: "File size limit exceeded"
    size = sandbox.exec("stat -c %s /workspace/big").stdout.strip()
    assert int(size) == 64 * 1024 * 1024
    sandbox.exec("rm /workspace/big")
    assert_usable(sandbox)


def test_no_process_is_left_after_close(sandbox, backend):
    # durations no other process on the host runs: the check looks only at this sandbox's
    marker = f"{secrets.randbelow(10**9):09d}"
    running = sandbox.exec(
        f"sleep 1002.{marker} & setsid nohup sleep 1003.{marker} >/dev/null 2>&1 & disown; "
        "sleep 0.2; cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '"
    )
    assert f"1003.{marker}" in running.stdout  # they ran: the check below can fail
    sandbox.close()
    if backend == "bwrap":
        leftover = [p for p in _host_processes() if p[1] == sandbox.uid and not _zombie(p[0])]
        assert leftover == []
        assert not sandbox.root.exists()
    else:
        import docker

        with pytest.raises(docker.errors.NotFound):
            docker.from_env().containers.get(sandbox.container.id)
    assert not any(f".{marker}" in cmd for _, _, cmd in _host_processes())


def test_symlinks_pointing_out_are_not_followed_when_copying_out(sandbox, host_secrets):
    token, paths = host_secrets
    sandbox.exec(f"ln -s {paths[0]} /workspace/file-link; ln -s / /workspace/root-link")
    for path in ("/workspace/file-link", f"/workspace/root-link{paths[0]}"):
        try:
            data = sandbox.read_file(path)
        except SandboxError:
            continue
        assert token.encode() not in data
    assert_usable(sandbox)


def test_symlinks_pointing_out_are_not_followed_when_copying_in(sandbox, tmp_path):
    sandbox.exec(f"ln -s {tmp_path} /workspace/dir-link")
    try:
        sandbox.write_file("/workspace/dir-link/planted.txt", "x")
    except SandboxError:
        pass
    assert list(tmp_path.iterdir()) == []
    assert_usable(sandbox)


def _zombie(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


def _host_processes():
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                cmd = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ")
                found.append((int(entry.name), entry.stat().st_uid, cmd.decode(errors="replace")))
            except OSError:
                continue
    return found


def test_no_process_of_the_sandbox_sees_the_trainers_environment(backend, monkeypatch):
    """An API key in the trainer's environment is in no process's environment inside the
    sandbox, pid 1 (bwrap's init, a fork of bwrap itself) included."""
    token = f"sk-{secrets.token_hex(16)}"
    monkeypatch.setenv("CLAWGYM_TEST_API_KEY", token)
    with make_sandbox(backend, SandboxConfig(timeout=10.0)) as sandbox:
        sandbox.start()
        result = sandbox.exec(
            "for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' <$f 2>/dev/null; done; "
            "echo; ls /proc | grep -c '^[0-9]'",
            timeout=10,
        )
    assert token not in result.stdout + result.stderr
    assert "PATH=" in result.stdout  # the environments were readable: the check saw them
    assert int(result.stdout.split()[-1]) >= 2  # pid 1 and the shell at least
