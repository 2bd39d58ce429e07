"""The one sandbox interface (DESIGN.md, "Sandbox") and the persistent shell behind it.

A `Sandbox` runs bash commands for an agent: `exec(cmd, timeout)` returns an `ExecResult`
(exit code, stdout, stderr, whether it timed out, how many bytes the output cap dropped),
`write_file` / `read_file` move files in and out, and `close()` ends every process the
sandbox started; it is idempotent and safe to call from another thread or while an
`exec` is being cancelled.

Every command runs in one long-lived bash per sandbox, so the working directory, shell
variables and exported environment persist between commands. The host speaks to that
shell over its stdin, stdout and stderr: a command is sent as a quoted here-document and
`eval`ed with stdin from /dev/null; after it, the shell prints an end marker with the
exit status on stdout and the working directory on stderr, so the host knows where each
command's output ends without a process per command. When a command outlives its
timeout every process but the shell is killed; if the shell itself is stuck (a builtin
loop) or has exited, a new shell starts with the last working directory and exported
variables restored. Backends (`bwrap.py`, `docker.py`) only supply the channel to a shell,
the means to kill and the measure of the sandbox's files.

The end marker cannot be forged by the command it ends. It carries a fresh random nonce
per command, sent on the line after the `eval` line: bash reads a pipe one byte at a time
(so that what it runs may read the rest), so that line stays unread in the pipe until
`eval` returns, and nothing in the shell's memory (variables, functions, `set` output)
holds it while the command runs. The host accepts only that command's nonce. What is
left: a process of the agent may open the shell's stdin pipe through /proc (bash keeps
it on fd 10 while `eval` reads /dev/null) and steal the unread line, where the pipe is
the agent's to open (the docker backend, where the agent is root; bwrap without root;
not bwrap as root, where the pipe belongs to the host's root); or it may redefine the
builtins that line calls (a function named `builtin`, a DEBUG trap) and forge the end
once its command has returned. Either way the next command kills whatever was left
running and, if the shell does not answer it, replaces the shell at its timeout; graders
restart the shell or use a fresh sandbox, so a forged end buys the agent only a false
observation.

Processes a command leaves running (`cmd &`, `nohup`, daemons) are killed when the next
command starts, unless `SandboxConfig.keep_background` says otherwise: a leftover would
otherwise run on between commands outside any timeout, writing files or using the CPU,
and no environment of this project needs one (task set-ups and graders run in the
foreground). A command that needs a server starts it and uses it in the same command.

The sandbox's files (what the agent can write: the writable directories and /tmp, or a
container's whole layer) have a budget of bytes and of files (`disk_mb`, `max_files`).
Backends measure them from the host; the usage is checked before each command, every
0.1 s or so while it runs (less often for a large tree, so that measuring costs at most a
tenth of the time) and after it. A command that grows the files past the budget is
stopped (as a timed-out one is) and the agent reads why; while over budget, commands run
but any that adds files is stopped, so deleting is how the agent gets back under. A fast
writer can overshoot by what it writes between two checks (a single file is bounded by
`max_file_mb`).
"""

from __future__ import annotations

import logging
import math
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
_END = "__clawgym_end_"  # the end marker is _END + the command's nonce + "__"
# Disk checks while a command runs: every 0.1 s, or ten times as long as a measure took
# (a tree of 100,000 files takes about 0.2 s), so that measuring costs a tenth of a core.
_DISK_CHECK_SECONDS = (0.1, 2.0)
_DISK_CHECK_COST = 10.0
_MB = 1024 * 1024

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
        disk_mb: bytes the sandbox's files may take on disk in all (see the module
            docstring); a gigabyte holds any task's tree and build outputs many times over.
        max_files: files, directories and links the sandbox's files may count; 100,000
            holds a large project with its git objects (a SWE workspace holds thousands).
        keep_background: let processes a command leaves running live on into the next
            commands; by default each command starts with none but the shell.
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
    disk_mb: int = 1024
    max_files: int = 100_000
    keep_background: bool = False

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
            "disk_mb": self.disk_mb,
            "max_files": self.max_files,
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


@dataclass(frozen=True)
class DiskUsage:
    """What a sandbox's files take on the host's disk.

    Attributes:
        bytes: bytes of allocated blocks (a sparse file counts what it uses; a file with
            several links counts once).
        files: files, directories and links.
    """

    bytes: int
    files: int

    def over(self, config: SandboxConfig) -> bool:
        """Whether this is past the budget of `config`."""
        return self.bytes > config.disk_mb * _MB or self.files > config.max_files

    def grew_past(self, start: DiskUsage, config: SandboxConfig) -> bool:
        """Whether a command that began at `start` pushed the bytes or the files up and
        past the budget; one that only deletes never did, so an agent over budget can
        always clean up."""
        return self.bytes > max(start.bytes, config.disk_mb * _MB) or self.files > max(
            start.files, config.max_files
        )

    def note(self, config: SandboxConfig, stopped: bool) -> str:
        """What the agent reads when this is over the budget."""
        used = f"{self.bytes / _MB:.0f} MB in {self.files} files"
        budget = f"{config.disk_mb} MB and {config.max_files} files"
        if stopped:
            return (
                f"\n[error] the command was stopped: the sandbox's files ({used}) grew past "
                f"its disk budget of {budget}; delete files to go on\n"
            )
        return (
            f"\n[error] the sandbox's files ({used}) are over its disk budget of {budget}; "
            "a command that adds files is stopped until enough are deleted\n"
        )


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

    def _disk_usage(self) -> DiskUsage | None:
        """What the sandbox's files take now, measured from the host; None where the
        backend cannot measure it (then the disk budget is not enforced)."""
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
            before = self._clear_leftovers()
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
        """Ends every process of the sandbox and frees it; idempotent and thread-safe. It
        never raises: whatever the agent made of the sandbox, the next episode's reset
        closes this one first (a failure to free is logged; the reapers retry)."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        channel, self._channel = self._channel, None
        try:
            self._release()
        except Exception:
            logger.exception("%s sandbox: freeing it failed", self.backend)
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
        nonce = secrets.token_hex(16)
        dirs = " ".join(_quote(p) for p in self.config.writable)
        # the saved state is the agent's to write: it must not read the lines that follow
        state = f". {_STATE_FILE} </dev/null 2>/dev/null" if restore else f"rm -f {_STATE_FILE}"
        init = (
            f"{state}\n"
            f"mkdir -p -- {dirs} 2>/dev/null; cd -- {_quote(self._cwd)} 2>/dev/null || cd /\n"
            f"{_end_line(nonce, status='0')}\n"
        )
        self._send(init)
        if self._collect(self.config.timeout + 30.0, nonce) is None:
            self._drop_shell(keep_shell=False)
            raise SandboxError("the sandbox's shell did not start")

    def _send(self, text: str) -> None:
        channel = self._channel
        if channel is None:
            self._check_open()
            raise SandboxError("the sandbox's shell is not running")
        channel.send(text.encode())

    def _run(self, cmd: str, limit: float) -> ExecResult:
        start = self._disk_usage()
        nonce = secrets.token_hex(16)
        delimiter = f"__CLAWGYM_EOF_{secrets.token_hex(8)}"
        # The end line waits unread in the pipe while the command runs (module docstring).
        self._send(
            f"IFS= read -r -d '' __cg_cmd <<'{delimiter}'\n{cmd}\n{delimiter}\n"
            f'eval "$__cg_cmd" </dev/null\n{_end_line(nonce)}\n'
        )
        streams = self._collect(limit, nonce, start=start)
        if streams is not None:
            result = self._check_process_limit(self._result(streams, "done", restarted=False))
            return self._check_disk(result, start, stopped=False)
        assert self._last is not None
        stopped = self._last[2] == "disk"
        return self._check_disk(self._stop(nonce), start, stopped=stopped)

    def _stop(self, nonce: str) -> ExecResult:
        """The result of a command `_collect` gave up on: one past its timeout or the disk
        budget has every process but the shell killed and the shell a moment to report;
        a shell that does not (a builtin loop), that exited or that goes on adding files
        meanwhile (a loop of the shell writing with children) is replaced."""
        assert self._last is not None
        out, err, reason = self._last
        if reason in ("timeout", "disk"):
            self._kill_processes(keep_shell=True)
            # measured again after the kill: any growth from here is the shell's own loop
            stopped_at = self._disk_usage()
            streams = self._collect(_GRACE_SECONDS, nonce, (out, err), start=stopped_at)
            if streams is not None:
                return self._result(streams, reason, restarted=False)
        status = self._shell_status() if reason == "exited" else None
        self._recover()
        result = self._result((out, err), reason, restarted=True)
        return result if status is None else replace(result, exit_code=status)

    def _collect(
        self,
        limit: float,
        nonce: str,
        streams: tuple[StreamEnd, StreamEnd] | None = None,
        start: DiskUsage | None = None,
    ) -> tuple[StreamEnd, StreamEnd] | None:
        """Reads until both end lines of the command with `nonce` arrived; None on timeout,
        a dead shell or, given the files' usage at the `start` of the command, files grown
        past the disk budget (the partial streams and the reason are left in `self._last`)."""
        cap = self.config.max_output
        mark = f"{_END}{nonce}__".encode()
        out, err = streams or (StreamEnd(mark, cap), StreamEnd(mark, cap))
        deadline = time.monotonic() + limit
        check = math.inf if start is None else time.monotonic() + _DISK_CHECK_SECONDS[0]
        channel = self._channel  # close() from another thread may clear the attribute
        if channel is None:
            self._check_open()
            raise SandboxError("the sandbox's shell is not running")
        while out.value is None or err.value is None:
            now = time.monotonic()
            if now >= deadline:
                self._last = (out, err, "timeout")
                return None
            chunks = channel.read(min(deadline, check, now + 0.5) - now)
            if chunks is None:
                self._check_open()
                self._last = (out, err, "exited")
                return None
            for stream, data in chunks:
                (out if stream == STDOUT else err).feed(data)
            ended = out.value is not None or err.value is not None
            if start is not None and not ended and time.monotonic() >= check:
                next_check = self._next_disk_check(start)
                if next_check is None:
                    self._last = (out, err, "disk")
                    return None
                check = next_check
        return out, err

    def _next_disk_check(self, start: DiskUsage) -> float | None:
        """Measures the sandbox's files: None when the command grew them past the budget,
        else when to measure next (sooner for a small tree, later for a large one)."""
        began = time.monotonic()
        usage = self._disk_usage()
        if usage is not None and usage.grew_past(start, self.config):
            return None
        now = time.monotonic()
        low, high = _DISK_CHECK_SECONDS
        return now + min(high, max(low, _DISK_CHECK_COST * (now - began)))

    def _check_disk(self, result: ExecResult, start: DiskUsage | None, stopped: bool) -> ExecResult:
        """`result` with the disk budget's note when the command was stopped for it or the
        sandbox's files are over it now."""
        usage = self._disk_usage() if start is not None else None
        if usage is None or not (stopped or usage.over(self.config)):
            return result
        return replace(result, stderr=result.stderr + usage.note(self.config, stopped))

    def _result(
        self, streams: tuple[StreamEnd, StreamEnd], reason: str, restarted: bool
    ) -> ExecResult:
        """The result of a command that ended for `reason` ("done", "timeout", "disk" or
        "exited")."""
        out, err = streams
        stdout, stdout_omitted = out.output.value()
        stderr, stderr_omitted = err.output.value()
        if err.value is not None:
            self._cwd = err.value.decode(errors="replace") or self._cwd
        timed_out = reason == "timeout"
        if timed_out:
            code = TIMEOUT_EXIT_CODE
        elif out.value is not None and out.value.isdigit():
            code = int(out.value)
        else:
            code = 1
        if restarted and reason == "exited":
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

    def _clear_leftovers(self) -> str:
        """Kills what earlier commands left running, unless `keep_background`; the note for
        the agent when it had filled the process limit (a fork bomb), else ""."""
        note = self._relieve_process_limit()
        if not note and not self.config.keep_background:
            self._kill_processes(keep_shell=True)
        return note

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

    # -- trees (envs/sandbox/trees.py) ---------------------------------------------------
    def export_tree(self, path: str) -> bytes:
        """The directory `path` as a tar archive of its directories, regular files and
        links, named relative to it (empty when it does not exist). Kills every process
        of the sandbox first, so nothing the agent left running changes it meanwhile.
        Raises `SandboxError` past the budgets of `trees.py`."""
        with self._exec_lock:
            self._check_open()
            self._drop_shell(keep_shell=False)
            self._dirty = False
            return self._export_tree(path)

    def import_tree(self, path: str, archive: bytes) -> None:
        """Unpacks an `export_tree` archive into the directory `path` (created if need be),
        over what is there."""
        with self._exec_lock:
            self._check_open()
            self._import_tree(path, archive)

    @abstractmethod
    def _export_tree(self, path: str) -> bytes:
        """`export_tree` of the backend, its processes already killed."""

    @abstractmethod
    def _import_tree(self, path: str, archive: bytes) -> None:
        """`import_tree` of the backend."""


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


def _end_line(nonce: str, status: str = "$?") -> str:
    """The shell line that ends a command: the end marker with the status on stdout and
    with the working directory on stderr, then the exports saved for a new shell. printf
    assembles the marker, so the line as bash echoes it (`set -v`) does not hold it; xtrace
    is paused so that an agent's `set -x` does not print it; `>|` writes through its
    `set -C`."""
    end = f"'{_END}%s__%s\\n' {nonce}"
    return (
        f"{{ __cg_s={status} __cg_x=$-; builtin set +x; }} 2>/dev/null; "
        f'builtin printf {end} "$__cg_s"; builtin printf {end} "$PWD" >&2; '
        f"builtin export -p >|{_STATE_FILE} 2>/dev/null; "
        "case $__cg_x in *x*) builtin set -x;; esac"
    )
