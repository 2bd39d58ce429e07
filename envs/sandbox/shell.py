"""The persistent shell behind every sandbox (docs/architecture.md, "Contracts": Sandbox)
and the protocol that runs commands in it.

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
import time
from abc import ABC, abstractmethod
from dataclasses import replace

from envs.sandbox.output import StreamEnd
from envs.sandbox.records import DiskUsage, ExecResult, SandboxClosed, SandboxConfig, SandboxError

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


class PersistentShell(ABC):
    """The one long-lived bash of a sandbox and the protocol spoken to it (the module
    docstring); a `Sandbox` is one, and its backend supplies the hooks below."""

    backend: str

    def __init__(self, config: SandboxConfig):
        self.config = config
        self._closed = False
        self._channel: ShellChannel | None = None
        self._cwd = config.workdir
        self._dirty = False  # an exec was interrupted: the shell's state is unknown
        self._last: tuple[StreamEnd, StreamEnd, str] | None = None
        self._limit_hits_seen: int | None = None  # _process_limit_hits at the last look

    # -- backend hooks -----------------------------------------------------------------
    @abstractmethod
    def _open_shell(self) -> ShellChannel:
        """Starts a new bash in the sandbox (the sandbox itself if need be)."""

    @abstractmethod
    def _kill_processes(self, keep_shell: bool) -> None:
        """Kills every process in the sandbox but its init and, if asked, the shell."""

    def _process_count(self) -> int | None:
        """How many processes the sandbox holds now, where the backend can tell cheaply."""
        return None

    def _process_limit_hits(self) -> int | None:
        """How many forks the kernel has refused at the sandbox's process limit so far (its
        pids cgroup's `max` event); None where the backend cannot tell."""
        return None

    def _shell_status(self) -> int | None:
        """The exit status of a shell that ended by itself, when the backend knows it."""
        return None

    def _disk_usage(self) -> DiskUsage | None:
        """What the sandbox's files take now, measured from the host; None where the
        backend cannot measure it (then the disk budget is not enforced)."""
        return None

    # -- internals ---------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SandboxClosed("the sandbox is closed")

    def _ensure_shell(self, restore: bool = True) -> None:
        if self._channel is not None:
            return
        self._channel = self._open_shell()
        self._limit_hits_seen = self._process_limit_hits()
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
            # never negative: a disk check skipped while one stream had ended leaves
            # `check` in the past, and a wait below zero is an error to select()
            chunks = channel.read(max(0.0, min(deadline, check, now + 0.5) - now))
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
        """Kills every process but the shell when the sandbox is at its process limit, or
        reached it since the last look; the note for the agent, or "" when neither. The
        kernel's count of refused forks is what tells: a bomb whose processes give up (bash
        exits a subshell whose fork failed for 15 s) hovers just under the limit, where the
        process count alone, read at one instant, can miss it."""
        count = self._process_count()
        hits, seen = self._process_limit_hits(), self._limit_hits_seen
        self._limit_hits_seen = hits
        refused = hits is not None and seen is not None and hits > seen
        if not refused and (count is None or count < self.config.max_procs - 4):
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
