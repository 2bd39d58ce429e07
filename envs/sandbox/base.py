"""The one sandbox interface (DESIGN.md, "Sandbox") and the persistent shell behind it.

A `Sandbox` runs bash commands for an agent: `exec(cmd, timeout)` returns an `ExecResult`
(exit code, stdout, stderr, whether it timed out, how many bytes the output cap dropped),
`write_file` / `read_file` move files in and out, and `close()` ends every process the
sandbox started; it is idempotent and safe to call from another thread or while an
`exec` is being cancelled.

Every command runs in one long-lived bash per sandbox, so the working directory, shell
variables and exported environment persist between commands. The host speaks to that
shell over its stdin, stdout and stderr: a command is sent as a quoted here-document and
`eval`ed with stdin from /dev/null; after it, the shell prints a per-session marker with
the exit status on stdout and the working directory on stderr, so the host knows where
each command's output ends without a process per command. When a command outlives its
timeout every process but the shell is killed; if the shell itself is stuck (a builtin
loop) or has exited, a new shell starts with the last working directory and exported
variables restored. Backends (`bwrap.py`, `docker.py`) only supply the channel to a shell
and the means to kill.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from envs.sandbox.output import StreamEnd

logger = logging.getLogger(__name__)

STDOUT, STDERR = 1, 2
TIMEOUT_EXIT_CODE = 124  # what coreutils' `timeout` returns
_STATE_FILE = "/tmp/.clawgym-shell-state"
_GRACE_SECONDS = 1.0  # after a timeout kill, how long the shell gets to report back

S = TypeVar("S", bound="Sandbox")


class SandboxError(RuntimeError):
    """A sandbox operation failed; the message is written for the agent to read."""


class SandboxClosed(SandboxError):
    """The sandbox was closed (possibly while a command ran)."""


@dataclass(frozen=True)
class SandboxConfig:
    """What a sandbox looks like from inside and what it may use.

    Attributes:
        workdir: the shell's starting directory.
        writable: directories the agent may write (besides a private /tmp).
        readonly: directories the host fills and the agent may only read (e.g. tests).
        env: extra environment variables of the shell.
        timeout: default seconds a command may run.
        max_output: bytes kept per stream of one command; the rest is dropped, visibly.
        memory_mb: memory of the whole sandbox.
        max_procs: processes and threads of the whole sandbox.
        cpus: CPU cores' worth of time the sandbox may use.
        cpu_seconds: CPU time of any one process before the kernel kills it.
        max_file_mb: largest file a process may write.
        max_read_mb: largest file `read_file` returns.
    """

    workdir: str = "/workspace"
    writable: tuple[str, ...] = ("/workspace",)
    readonly: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    timeout: float = 30.0
    max_output: int = 64 * 1024
    memory_mb: int = 1024
    max_procs: int = 256
    cpus: float = 1.0
    cpu_seconds: int = 600
    max_file_mb: int = 256
    max_read_mb: int = 64

    def __post_init__(self) -> None:
        for path in (self.workdir, *self.writable, *self.readonly):
            if not path.startswith("/") or ".." in path.split("/"):
                raise ValueError(f"sandbox paths must be absolute without '..', got {path!r}")
        for path in (*self.writable, *self.readonly):
            if path in ("/", "/tmp", "/proc", "/dev", "/usr", "/etc"):
                raise ValueError(f"{path!r} cannot be a sandbox mount; use a directory of its own")
        numbers = {
            "timeout": self.timeout,
            "max_output": self.max_output,
            "memory_mb": self.memory_mb,
            "max_procs": self.max_procs,
            "cpus": self.cpus,
            "cpu_seconds": self.cpu_seconds,
            "max_file_mb": self.max_file_mb,
            "max_read_mb": self.max_read_mb,
        }
        for name, value in numbers.items():
            if value <= 0:
                raise ValueError(f"SandboxConfig.{name} must be positive, got {value}")
        if self.max_output < 256:
            raise ValueError(f"max_output must be at least 256 bytes, got {self.max_output}")


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one command.

    Attributes:
        exit_code: the command's status; 124 when it timed out.
        stdout: its standard output (decoded, invalid UTF-8 replaced).
        stderr: its standard error.
        timed_out: it was killed for running past its timeout.
        stdout_omitted: bytes of stdout the output cap dropped (a marker shows where).
        stderr_omitted: bytes of stderr the output cap dropped.
        shell_restarted: the shell was replaced after this command (it exited or hung);
            the working directory and exported variables were restored, the rest was not.
    """

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    stdout_omitted: int = 0
    stderr_omitted: int = 0
    shell_restarted: bool = False

    @property
    def truncated(self) -> bool:
        """Whether the output cap dropped anything."""
        return bool(self.stdout_omitted or self.stderr_omitted)


class ShellChannel(ABC):
    """A byte pipe to one running bash: its stdin, and its stdout and stderr."""

    @abstractmethod
    def send(self, data: bytes) -> None:
        """Writes to the shell's stdin; raises `SandboxError` if the shell is gone."""

    @abstractmethod
    def read(self, timeout: float) -> list[tuple[int, bytes]] | None:
        """Output that arrived within `timeout` seconds as (STDOUT | STDERR, bytes); None
        once the shell has exited and its output is drained."""

    @abstractmethod
    def close(self) -> None:
        """Releases the channel (not the sandbox)."""


class Sandbox(ABC):
    """A place to run an agent's commands; see the module docstring."""

    backend = "abstract"

    def __init__(self, config: SandboxConfig):
        self.config = config
        self._mark = f"__clawgym_{secrets.token_hex(8)}__".encode()
        self._exec_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._closed = False
        self._channel: ShellChannel | None = None
        self._cwd = config.workdir
        self._dirty = False  # an exec was interrupted: the shell's state is unknown
        self._last: tuple[StreamEnd, StreamEnd, str] | None = None

    # -- backend hooks -----------------------------------------------------------------
    @abstractmethod
    def _open_shell(self) -> ShellChannel:
        """Starts a new bash in the sandbox (the sandbox itself if need be)."""

    @abstractmethod
    def _kill_processes(self, keep_shell: bool) -> None:
        """Kills every process in the sandbox but its init and, if asked, the shell."""

    @abstractmethod
    def _release(self) -> None:
        """Ends every process and frees every resource; called once, by `close`."""

    def _process_count(self) -> int | None:
        """How many processes the sandbox holds now, where the backend can tell cheaply."""
        return None

    def _shell_status(self) -> int | None:
        """The exit status of a shell that ended by itself, when the backend knows it."""
        return None

    @abstractmethod
    def write_file(self, path: str, data: bytes | str) -> None:
        """Writes a file (creating its directories) at an absolute path in the sandbox."""

    @abstractmethod
    def read_file(self, path: str) -> bytes:
        """Reads a file of the sandbox without following links out of it."""

    # -- the shell ---------------------------------------------------------------------
    def start(self) -> None:
        """Starts the shell now rather than at the first command (what `reset` measures)."""
        with self._exec_lock:
            self._ensure_shell()

    def exec(self, cmd: str, timeout: float | None = None) -> ExecResult:
        """Runs `cmd` in the sandbox's shell and returns its result.

        Args:
            cmd: bash source; may span lines, use pipes, change directory.
            timeout: seconds before every process of the command is killed.
        """
        limit = self.config.timeout if timeout is None else timeout
        if limit <= 0:
            raise ValueError(f"timeout must be positive, got {limit}")
        with self._exec_lock:
            self._check_open()
            if self._dirty:
                self._recover()
            self._ensure_shell()
            self._dirty = True
            before = self._relieve_process_limit()  # a bomb that filled up since the last one
            result = self._run(cmd.replace("\0", ""), limit)
            self._dirty = False
            return replace(result, stderr=before.lstrip("\n") + result.stderr) if before else result

    def restart_shell(self) -> None:
        """Kills every process in the sandbox and starts a fresh shell in `workdir` with
        none of the agent's shell state (graders use it before running tests)."""
        with self._exec_lock:
            self._check_open()
            self._drop_shell(keep_shell=False)
            self._cwd = self.config.workdir
            self._ensure_shell(restore=False)

    def close(self) -> None:
        """Ends every process of the sandbox and frees it; idempotent and thread-safe."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        channel, self._channel = self._channel, None
        try:
            self._release()
        finally:
            if channel is not None:
                channel.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SandboxClosed("the sandbox is closed")

    def _ensure_shell(self, restore: bool = True) -> None:
        if self._channel is not None:
            return
        self._channel = self._open_shell()
        mark = self._mark.decode()
        dirs = " ".join(_quote(p) for p in self.config.writable)
        state = f". {_STATE_FILE} 2>/dev/null" if restore else f"rm -f {_STATE_FILE}"
        init = (
            f"__cg_mark={mark}\n"
            # xtrace is paused so that a `set -x` of the agent cannot echo the marker
            "__cg_done() { { __cg_x=$-; set +x; } 2>/dev/null; "
            'printf \'%s%d\\n\' "$__cg_mark" "$1"; '
            'printf \'%s%s\\n\' "$__cg_mark" "$PWD" >&2; '
            f"export -p >{_STATE_FILE} 2>/dev/null; "
            "case $__cg_x in *x*) set -x;; esac; }\n"
            f"{state}\n"
            f"mkdir -p -- {dirs} 2>/dev/null; cd -- {_quote(self._cwd)} 2>/dev/null || cd /\n"
            "__cg_done 0\n"
        )
        self._send(init)
        if self._collect(self.config.timeout + 30.0) is None:
            self._drop_shell(keep_shell=False)
            raise SandboxError("the sandbox's shell did not start")

    def _send(self, text: str) -> None:
        channel = self._channel
        if channel is None:
            self._check_open()
            raise SandboxError("the sandbox's shell is not running")
        channel.send(text.encode())

    def _run(self, cmd: str, limit: float) -> ExecResult:
        delimiter = f"__CLAWGYM_EOF_{secrets.token_hex(8)}"
        self._send(
            f"IFS= read -r -d '' __cg_cmd <<'{delimiter}'\n{cmd}\n{delimiter}\n"
            'eval "$__cg_cmd" </dev/null\n__cg_done $?\n'
        )
        streams = self._collect(limit)
        if streams is not None:
            return self._check_process_limit(self._result(streams, False, False))
        assert self._last is not None
        out, err, reason = self._last
        if reason == "timeout":
            self._kill_processes(keep_shell=True)
            streams = self._collect(_GRACE_SECONDS, (out, err))
            if streams is not None:
                return self._result(streams, timed_out=True, restarted=False)
        status = None if reason == "timeout" else self._shell_status()
        self._recover()
        result = self._result((out, err), timed_out=reason == "timeout", restarted=True)
        return result if status is None else replace(result, exit_code=status)

    def _collect(
        self, limit: float, streams: tuple[StreamEnd, StreamEnd] | None = None
    ) -> tuple[StreamEnd, StreamEnd] | None:
        """Reads until both marker lines arrived; None on timeout or a dead shell (the
        partial streams and the reason are left in `self._last`)."""
        cap = self.config.max_output
        out, err = streams or (StreamEnd(self._mark, cap), StreamEnd(self._mark, cap))
        deadline = time.monotonic() + limit
        channel = self._channel  # close() from another thread may clear the attribute
        if channel is None:
            self._check_open()
            raise SandboxError("the sandbox's shell is not running")
        while out.value is None or err.value is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._last = (out, err, "timeout")
                return None
            chunks = channel.read(min(remaining, 0.5))
            if chunks is None:
                self._check_open()
                self._last = (out, err, "exited")
                return None
            for stream, data in chunks:
                (out if stream == STDOUT else err).feed(data)
        return out, err

    def _result(
        self, streams: tuple[StreamEnd, StreamEnd], timed_out: bool, restarted: bool
    ) -> ExecResult:
        out, err = streams
        stdout, stdout_omitted = out.output.value()
        stderr, stderr_omitted = err.output.value()
        if err.value is not None:
            self._cwd = err.value.decode(errors="replace") or self._cwd
        if timed_out:
            code = TIMEOUT_EXIT_CODE
        elif out.value is not None and out.value.isdigit():
            code = int(out.value)
        else:
            code = 1
        if restarted and not timed_out:
            stderr += b"\n[the shell exited; a new one was started]\n"
        return ExecResult(
            exit_code=code,
            stdout=stdout.decode(errors="replace"),
            stderr=stderr.decode(errors="replace"),
            timed_out=timed_out,
            stdout_omitted=stdout_omitted,
            stderr_omitted=stderr_omitted,
            shell_restarted=restarted,
        )

    def _check_process_limit(self, result: ExecResult) -> ExecResult:
        """A sandbox at its process limit (a fork bomb left running in the background) is
        useless for the next command: every process but the shell is killed, visibly."""
        note = self._relieve_process_limit()
        return replace(result, stderr=result.stderr + note) if note else result

    def _relieve_process_limit(self) -> str:
        """Kills every process but the shell when the sandbox is at its process limit; the
        note for the agent, or "" when it is not."""
        count = self._process_count()
        if count is None or count < self.config.max_procs - 4:
            return ""
        self._kill_processes(keep_shell=True)
        return (
            f"\n[error] the sandbox reached its limit of {self.config.max_procs} processes; "
            "every process but the shell was killed\n"
        )

    def _recover(self) -> None:
        """Replaces a hung or dead shell, keeping the working directory and exports."""
        logger.info("%s sandbox: replacing its shell", self.backend)
        self._drop_shell(keep_shell=False)
        self._ensure_shell()
        self._dirty = False

    def _drop_shell(self, keep_shell: bool) -> None:
        self._kill_processes(keep_shell=keep_shell)
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()


@contextmanager
def closed_on_failure(sandbox: S) -> Iterator[S]:
    """Yields `sandbox` and closes it if the block raises: a sandbox that failed to start
    or to be filled leaves no process or workspace behind.

        with closed_on_failure(make_sandbox(backend, config)) as sandbox:
            sandbox.start()
    """
    try:
        yield sandbox
    except BaseException:
        sandbox.close()
        raise


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"
