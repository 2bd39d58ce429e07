"""The byte channels to a sandbox's shell, on real sockets and without a daemon: what a
busy machine does to them (a CI run lost docker shells to each of these) must not read
as a shell that exited."""

from __future__ import annotations

import http.client
import os
import re
import socket
import time
from types import SimpleNamespace

import pytest

from envs.sandbox.docker import SocketChannel
from envs.sandbox.records import DiskUsage, SandboxConfig
from envs.sandbox.shell import STDERR, STDOUT, PersistentShell, ShellChannel


def frame(stream: int, data: bytes) -> bytes:
    """One frame of the daemon's multiplexed stream: stream, 3 zero bytes, length, data."""
    return bytes([stream, 0, 0, 0]) + len(data).to_bytes(4, "big") + data


def upgraded(first_bytes: bytes) -> tuple[object, socket.socket]:
    """A hijacked connection as the Docker SDK hands it over (the socket wrapper under an
    HTTP response that keeps a reference to it), whose daemon end sent the upgrade's
    headers and `first_bytes` in one piece; and the daemon's end."""
    ours, daemon = socket.socketpair()
    daemon.sendall(
        b"HTTP/1.1 101 UPGRADED\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n" + first_bytes
    )
    response = http.client.HTTPResponse(ours)
    response.begin()  # reads the headers through a buffer, and with them what followed
    raw = response.fp.raw
    raw._response = SimpleNamespace(raw=SimpleNamespace(_fp=response))
    return raw, daemon


def test_the_shells_first_words_sent_with_the_upgrade_are_not_lost():
    raw, daemon = upgraded(frame(STDOUT, b"42\n"))
    channel = SocketChannel(raw)
    try:
        assert channel.read(0.5) == [(STDOUT, b"42\n")]
        daemon.sendall(frame(STDERR, b"later"))
        assert channel.read(0.5) == [(STDERR, b"later")]
    finally:
        channel.close()
        daemon.close()


def test_a_wait_below_zero_is_no_wait_and_no_end():
    raw, daemon = upgraded(b"")
    channel = SocketChannel(raw)
    try:
        assert channel.read(-0.2) == []
        daemon.sendall(frame(STDOUT, b"still here"))
        assert channel.read(0.5) == [(STDOUT, b"still here")]
        daemon.close()
        assert channel.read(0.5) is None  # the real end
    finally:
        channel.close()


def test_a_socket_numbered_past_1024_is_read():
    held = []
    try:
        while len(held) < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pytest.skip("this process may not hold 1,100 files")
    try:
        raw, daemon = upgraded(b"")
        channel = SocketChannel(raw)
        assert channel.sock.fileno() > 1024
        daemon.sendall(frame(STDOUT, b"ok"))
        assert channel.read(0.5) == [(STDOUT, b"ok")]
        channel.close()
        daemon.close()
    finally:
        for fd in held:
            os.close(fd)


class SlowStderrChannel(ShellChannel):
    """Plays bash's part of the protocol: each command's end comes on stdout at once and on
    stderr only after `lag` seconds (a process descheduled on a busy machine). Like
    select(), it refuses a negative wait."""

    def __init__(self, lag: float):
        self.lag = lag
        self.pending: list[tuple[float, int, bytes]] = []
        self.waits: list[float] = []

    def send(self, data: bytes) -> None:
        nonce = re.findall(rb"__clawgym_end_%s__%s\\n' ([0-9a-f]+)", data)[-1]
        end = b"__clawgym_end_" + nonce + b"__"
        now = time.monotonic()
        self.pending += [(now, STDOUT, end + b"0\n"), (now + self.lag, STDERR, end + b"/\n")]

    def read(self, timeout: float) -> list[tuple[int, bytes]] | None:
        if timeout < 0:
            raise ValueError("timeout must be non-negative")
        self.waits.append(timeout)
        due = [item for item in self.pending if item[0] <= time.monotonic()]
        if not due:
            time.sleep(min(timeout, 0.02))
            return []
        self.pending.remove(due[0])
        if due[0][1] == STDOUT:
            time.sleep(self.lag)  # past the next disk check, with one stream ended
        return [due[0][1:]]

    def close(self) -> None:
        pass


class ScriptedShell(PersistentShell):
    backend = "scripted"

    def __init__(self, channel: ShellChannel):
        super().__init__(SandboxConfig())
        self.channel = channel

    def _open_shell(self) -> ShellChannel:
        return self.channel

    def _kill_processes(self, keep_shell: bool) -> None:
        pass

    def _disk_usage(self) -> DiskUsage:
        return DiskUsage(bytes=0, files=0)  # measured, so disk checks are due while it runs


def test_a_disk_check_skipped_while_one_stream_had_ended_never_asks_for_a_negative_wait():
    channel = SlowStderrChannel(lag=0.25)
    shell = ScriptedShell(channel)
    shell._ensure_shell()
    result = shell._run("true", limit=10.0)
    assert (result.exit_code, result.shell_restarted) == (0, False)
    assert min(channel.waits) >= 0
