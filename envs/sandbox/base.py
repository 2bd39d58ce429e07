"""The one sandbox interface (docs/architecture.md, "Contracts": Sandbox).

A `Sandbox` runs bash commands for an agent: `exec(cmd, timeout)` returns an `ExecResult`
(exit code, stdout, stderr, whether it timed out, how many bytes the output cap dropped),
`write_file` / `read_file` move files in and out, `export_tree` / `import_tree` move whole
directories, and `close()` ends every process the sandbox started; it is idempotent and
safe to call from another thread or while an `exec` is being cancelled.

Every command runs in one long-lived bash per sandbox (`shell.py`: how commands, their
ends, timeouts, leftover processes and the disk budget are handled). Backends
(`bwrap.py`, `docker.py`) only supply the channel to a shell, the means to kill and the
measure of the sandbox's files.
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, TypeVar

from envs.sandbox.records import ExecResult, SandboxConfig
from envs.sandbox.shell import PersistentShell

logger = logging.getLogger(__name__)

S = TypeVar("S", bound="Sandbox")


class Sandbox(PersistentShell):
    """A place to run an agent's commands; see the module docstring."""

    backend = "abstract"

    def __init__(self, config: SandboxConfig):
        super().__init__(config)
        self._exec_lock = threading.Lock()
        self._state_lock = threading.Lock()

    # -- backend hooks (and those of the shell, shell.py) ------------------------------
    @abstractmethod
    def _release(self) -> None:
        """Ends every process and frees every resource; called once, by `close`."""

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
