"""vLLM's OpenAI server as a child process: started in its own process group on a free
loopback port, waited for until `/health` answers, and stopped with its whole process tree.

A `ServerProcess` stops its server on `stop()`, when the interpreter exits (also after an
uncaught Ctrl-C), and on SIGTERM (a handler is installed the first time a server starts,
only where SIGTERM still has its default action). A server killed with SIGKILL of this
process is not reached: nothing can run then.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType

import httpx

logger = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[ServerProcess] = weakref.WeakSet()
_HOOKS = threading.Lock()
_hooked = False


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`, read from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state, ppid, pgrp, ...
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


class ServerProcess:
    """One server child process (see the module docstring).

    Args:
        command: the server's command line; it must serve `/health` on `port`.
        port: the loopback port it listens on.
        env: its environment variables (added to this process's).
        startup_timeout: seconds to wait for `/health` before giving up.
    """

    def __init__(
        self,
        command: Sequence[str],
        port: int,
        env: Mapping[str, str],
        startup_timeout: float = 300.0,
    ):
        self.port = port
        log = tempfile.NamedTemporaryFile(prefix="clawgym-vllm-", suffix=".log", delete=False)
        self.log_path = Path(log.name)
        _install_hooks()
        logger.info("starting %s (log: %s)", " ".join(command), self.log_path)
        self._process = subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,  # its own process group: stopped as a whole
        )
        log.close()
        self.pid = self._process.pid
        self._stopped = False
        _LIVE.add(self)
        try:
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        started = time.monotonic()
        url = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() - started < timeout:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"the vLLM server exited with code {self._process.returncode} while "
                    f"starting; its log ({self.log_path}) ends with:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2.0).status_code == 200:
                    logger.info("vLLM server up in %.1f s", time.monotonic() - started)
                    return
            time.sleep(0.5)
        raise TimeoutError(
            f"the vLLM server did not answer /health within {timeout:.0f} s; its log "
            f"({self.log_path}) ends with:\n{self.log_tail()}"
        )

    def alive(self) -> bool:
        return self._process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to the whole process group, SIGKILL to what is left after `grace`
        seconds; idempotent. The log file is removed once the server stopped."""
        if self._stopped:
            return
        self._stopped = True
        _signal_group(self.pid, signal.SIGTERM)
        try:
            self._process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            logger.warning("vLLM server %d ignored SIGTERM; killing it", self.pid)
        deadline = time.monotonic() + grace
        while group_members(self.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        _signal_group(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=grace)
        self.log_path.unlink(missing_ok=True)
        logger.info("vLLM server %d stopped", self.pid)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(grace=5.0)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _stop_all()
    # Then die of SIGTERM as if no handler had been installed.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_hooks() -> None:
    """Once per process: stop every server at exit, and on SIGTERM where SIGTERM would
    otherwise kill this process without running exit handlers."""
    global _hooked
    with _HOOKS:
        if _hooked:
            return
        _hooked = True
        atexit.register(_stop_all)
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                signal.signal(signal.SIGTERM, _on_sigterm)
