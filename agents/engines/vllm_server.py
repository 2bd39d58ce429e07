"""vLLM's OpenAI server as a child process: started in its own process group on a free
loopback port, waited for until `/health` answers, and stopped with its whole process tree.

A `ServerProcess` stops its server on `stop()`, when the interpreter exits (also after an
uncaught Ctrl-C), and on SIGTERM (a handler is installed the first time a server starts,
only where SIGTERM still has its default action). A server killed with SIGKILL of this
process is not reached: nothing can run then.

Failures say where to look: a server that exits or does not answer while starting raises
`ServerStartError` (or `TimeoutError`) with its port, exit code and the tail of its log, and
one that exits later is reported by `death()` as `EngineDied`. The log file is kept whenever
the server failed and removed only after a clean `stop()`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
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
# vLLM's prefix of a line logged by one of its processes: "(EngineCore pid=12) ERROR 11-24
# 23:07:09 [core.py:1510] ".
_PREFIX = re.compile(r"^\([^)]*\) (?:[A-Z]+ [\d-]+ [\d:]+ \[[^\]]*\] )?")
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception): \S")
_HOOKS = threading.Lock()
_hooked = False


DEATH_GRACE_S = 5.0
"""How long a caller whose request failed on an unhealthy server waits for it to exit: vLLM's
API server answers 500 for 2-3 s after its engine core died before it exits (measured)."""


class ServerStartError(RuntimeError):
    """The server did not start (its port was taken, or it exited while starting)."""


class EngineDied(RuntimeError):
    """The server exited while it was serving (killed, out of memory, crashed); the message
    names its kept log file and ends with the log's tail."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def port_taken(port: int) -> bool:
    """Whether something listens on 127.0.0.1:`port`. Bound as uvicorn binds (SO_REUSEADDR),
    so a port that only has closed connections waiting out TIME_WAIT counts as free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


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

    Raises:
        ServerStartError: the port is taken (nothing is started then), or the server exited
            while starting.
        TimeoutError: it did not answer `/health` within `startup_timeout`.
    """

    def __init__(
        self,
        command: Sequence[str],
        port: int,
        env: Mapping[str, str],
        startup_timeout: float = 300.0,
    ):
        self.port = port
        if port_taken(port):
            # Checked first: a foreign server there could answer /health for this one.
            raise ServerStartError(
                f"port {port} of 127.0.0.1 is already in use: stop what listens there, or "
                "leave the port unset to take a free one"
            )
        log = tempfile.NamedTemporaryFile(prefix="clawgym-vllm-", suffix=".log", delete=False)
        self.log_path = Path(log.name)
        _install_hooks()
        logger.info("starting %s (log: %s)", " ".join(command), self.log_path)
        try:
            self._process = subprocess.Popen(
                list(command),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,  # its own process group: stopped as a whole
            )
        except OSError:
            self.log_path.unlink(missing_ok=True)
            raise
        finally:
            log.close()
        self.pid = self._process.pid
        self._stopped = False
        self._failed = False
        _LIVE.add(self)
        try:
            self._wait_healthy(startup_timeout)
        except Exception:
            self._failed = True  # its log is kept for the error message
            self.stop()
            raise
        except BaseException:  # Ctrl-C or SIGTERM while it starts: not its failure
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self._process.poll() is not None:
                raise ServerStartError(
                    f"the vLLM server (pid {self.pid}, port {self.port}) exited with "
                    f"{_exit_text(self._process.returncode)} while starting; {self._log_text()}"
                )
            if self.healthy():
                logger.info("vLLM server up in %.1f s", time.monotonic() - started)
                return
            time.sleep(0.5)
        raise TimeoutError(
            f"the vLLM server (pid {self.pid}, port {self.port}) did not answer /health "
            f"within {timeout:.0f} s; {self._log_text()}"
        )

    def alive(self) -> bool:
        return self._process.poll() is None

    def healthy(self, timeout: float = 2.0) -> bool:
        """Whether `/health` answers 200: vLLM answers 503 once its engine core died, a
        moment before its API server exits."""
        with contextlib.suppress(httpx.HTTPError):
            url = f"http://127.0.0.1:{self.port}/health"
            return httpx.get(url, timeout=timeout).status_code == 200
        return False

    def death(self, wait: float = 0.0) -> EngineDied | None:
        """The error to raise when the server exited without `stop()` (None while it runs, or
        after `stop()`), waiting up to `wait` seconds for it to exit. Callers ask only after
        a request failed: the hot path pays nothing for it."""
        if self._stopped:
            return None
        try:
            code = self._process.wait(timeout=wait) if wait > 0 else self._process.poll()
        except subprocess.TimeoutExpired:
            return None
        if code is None:
            return None
        self._failed = True
        return EngineDied(
            f"the vLLM server (pid {self.pid}, port {self.port}) exited with "
            f"{_exit_text(code)}; {self._log_text()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _log_text(self) -> str:
        """The log's first error (the root cause: vLLM's processes re-raise it several
        times), its path and its tail."""
        try:
            first = first_error(self.log_path.read_text(errors="replace"))
        except OSError:
            first = None
        cause = f"first error: {first}; " if first else ""
        return f"{cause}its log ({self.log_path}) ends with:\n{self.log_tail()}"

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to the whole process group, SIGKILL to what is left after `grace`
        seconds; idempotent. The log file is removed once a healthy server stopped, and kept
        (its path logged) when the server had failed or already exited."""
        if self._stopped:
            return
        self._stopped = True
        clean = not self._failed and self._process.poll() is None
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
        if clean:
            self.log_path.unlink(missing_ok=True)
            logger.info("vLLM server %d stopped", self.pid)
        else:
            logger.warning(
                "vLLM server %d stopped after a failure; log kept: %s", self.pid, self.log_path
            )


def first_error(log: str) -> str | None:
    """The first exception line of a log ("ValueError: ..."), vLLM's line prefix removed."""
    for line in log.splitlines():
        line = _PREFIX.sub("", line).strip()
        if _RAISED.match(line):
            return line
    return None


def _exit_text(code: int) -> str:
    """`code 1`, or `code -9 (SIGKILL)` for a process a signal ended."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"code {code} ({signal.Signals(-code).name})"
    return f"code {code}"


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
