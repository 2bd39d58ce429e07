"""The bubblewrap backend: Linux namespaces around a persistent bash, ready in milliseconds.

What it isolates:
- network: a network namespace of its own with only a loopback device, so neither the
  internet nor the host's loopback services (127.0.0.1 of the host) can be reached;
- file system: a fresh root holding the host's /usr and /etc read-only, its own /dev
  (read-only but for a 64 MB /dev/shm, as Docker's, with bubblewrap 0.5 or later), /proc
  and private /tmp; the configured `writable` directories are the only other writable
  places, and the host's home directories, /work, /root, /var, runs and stores are simply
  not there;
- disk: /tmp and the writable directories are host directories under one temporary root,
  held together to `disk_mb` and `max_files` (measured from the host; see shell.py for how
  commands are stopped); a size-limited tmpfs would bound them in the kernel, but the
  host reads and writes those directories (files, trees, graders), and a tmpfs is memory;
- processes: pid, ipc, uts and user namespaces; the sandbox cannot see or signal host
  processes, and every process dies with the sandbox (`--die-with-parent`, and a kill of
  the whole tree on close); the root directory and cgroups of a sandbox whose owning
  process died without closing it (named after that process's pid and start time) are
  removed by the first sandbox of a later process (`cleanup.reap_bwrap_orphans`);
- environment: bwrap itself, its init and the shell start from an explicit environment
  (PATH, HOME, LANG, TERM and the config's `env`), so none of the trainer's variables (API
  keys of a judge or W&B) is readable, not even in `/proc/1/environ`;
- resources: as root it runs under a uid of its own in cgroups (memory, pids, cpu) where
  the host allows creating them, and always under rlimits (processes, address space, CPU
  seconds per process, file size).

What it does not isolate:
- the kernel: it is shared, so a kernel exploit escapes (use the docker backend, or a VM);
- the host's installed software is visible read-only (/usr, /etc), including its versions;
- the disk budget is checked, not enforced by the kernel: a fast writer overshoots it by
  what it writes between two checks; without root, a directory the agent makes unreadable
  (chmod 000) hides its contents from the measure;
- without root (no dedicated uid, no cgroups) process and memory limits are per-process
  rlimits only, and processes count against the calling user's total.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import selectors
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from envs.sandbox.base import Sandbox
from envs.sandbox.cleanup import BWRAP_PREFIX, reap_bwrap_orphans, remove_tree
from envs.sandbox.limits import (
    HostLimits,
    disk_usage,
)
from envs.sandbox.processes import (
    children,
    descendants,
    kill,
    kill_until_gone,
    process_start_time,
    processes_of_uid,
    zombie,
)
from envs.sandbox.records import DiskUsage, SandboxConfig, SandboxError
from envs.sandbox.shell import STDERR, STDOUT, ShellChannel
from envs.sandbox.trees import pack_directory, unpack_directory

logger = logging.getLogger(__name__)

_UIDS = itertools.count()
_SPAWNER: ThreadPoolExecutor | None = None
_SPAWNER_LOCK = threading.Lock()
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_SYSTEM = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_SHM_BYTES = 64 * 1024 * 1024  # Docker's default size of /dev/shm
_reaped = threading.Event()


def bwrap_available() -> bool:
    """Whether `bwrap` is installed (it may still fail where user namespaces are off)."""
    return shutil.which("bwrap") is not None


@functools.cache
def _sizes_tmpfs() -> bool:
    """Whether this bwrap can give a tmpfs a size (`--size`, bubblewrap 0.5 and later)."""
    result = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, check=False)
    return "--size" in result.stdout


class PipeChannel(ShellChannel):
    """A shell that is a child process of ours, spoken to over pipes."""

    def __init__(self, process: subprocess.Popen[bytes]):
        assert process.stdin and process.stdout and process.stderr
        self.process = process
        self._selector = selectors.DefaultSelector()
        for stream, pipe in ((STDOUT, process.stdout), (STDERR, process.stderr)):
            os.set_blocking(pipe.fileno(), False)
            self._selector.register(pipe.fileno(), selectors.EVENT_READ, stream)
        self._open = 2

    def send(self, data: bytes) -> None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(data)
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as error:
            raise SandboxError(f"the shell is gone ({error})") from None

    def read(self, timeout: float) -> list[tuple[int, bytes]] | None:
        if self._open == 0:
            return None
        chunks: list[tuple[int, bytes]] = []
        try:
            events = self._selector.select(timeout)
        except (OSError, ValueError):
            return None  # closed from another thread
        for key, _ in events:
            try:
                data = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                chunks.append((key.data, data))
            else:
                self._selector.unregister(key.fd)
                self._open -= 1
        return None if self._open == 0 and not chunks else chunks

    def close(self) -> None:
        self._selector.close()
        for pipe in (self.process.stdin, self.process.stdout, self.process.stderr):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass


class BwrapSandbox(Sandbox):
    """A bubblewrap sandbox; see the module docstring for what it does and does not isolate.

    Args:
        config: paths and limits.
    """

    backend = "bwrap"

    def __init__(self, config: SandboxConfig | None = None):
        super().__init__(config or SandboxConfig())
        if not bwrap_available():
            raise SandboxError("bubblewrap is not installed; run scripts/setup.sh as root")
        if not _reaped.is_set():
            _reaped.set()
            reap_bwrap_orphans()
        pid = os.getpid()
        self.root = Path(tempfile.mkdtemp(prefix=f"{BWRAP_PREFIX}{pid}-{process_start_time(pid)}-"))
        self.root.chmod(0o711)  # the sandbox uid must reach its mounts, not list them
        self.uid = _sandbox_uid()
        self.mounts = self._make_mounts()
        self.limits = HostLimits(self.config, self.root.name, self.uid)
        self._process: subprocess.Popen[bytes] | None = None

    # -- mounts --------------------------------------------------------------------------
    def _make_mounts(self) -> dict[str, Path]:
        """Sandbox path -> host directory, for /tmp and every writable or read-only dir."""
        mounts: dict[str, Path] = {}
        for index, path in enumerate(("/tmp", *self.config.writable, *self.config.readonly)):
            host = self.root / f"m{index}"
            host.mkdir(mode=0o755)
            writable = path not in self.config.readonly
            if writable and os.geteuid() == 0:
                os.chown(host, self.uid, self.uid)
            mounts[path] = host
        return mounts

    def _argv(self) -> list[str]:
        argv = ["bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"]
        argv += ["--disable-userns", "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
        for name in _SYSTEM:
            host = Path("/") / name
            if host.is_symlink():
                argv += ["--symlink", os.readlink(host), f"/{name}"]
            elif host.is_dir():
                argv += ["--ro-bind", str(host), f"/{name}"]
        argv += ["--dev", "/dev"]
        if _sizes_tmpfs():  # else /dev stays a writable tmpfs, bounded by memory alone
            argv += ["--perms", "1777", "--size", str(_SHM_BYTES), "--tmpfs", "/dev/shm"]
            argv += ["--remount-ro", "/dev"]
        argv += ["--proc", "/proc"]
        for path, host in self.mounts.items():
            kind = "--ro-bind" if path in self.config.readonly else "--bind"
            argv += [kind, str(host), path]
        argv += ["--remount-ro", "/", "--chdir", "/", "--hostname", "sandbox", "--clearenv"]
        env = {"PATH": _PATH, "HOME": "/tmp", "LANG": "C.UTF-8", "TERM": "dumb"}
        for key, value in {**env, **dict(self.config.env)}.items():
            argv += ["--setenv", key, value]
        return [*argv, "--", "/bin/bash", "--noprofile", "--norc"]

    # -- Sandbox hooks -------------------------------------------------------------------
    def _open_shell(self) -> ShellChannel:
        self._check_open()
        argv = self._argv()
        if os.geteuid() == 0:  # cgroups are joined and rlimits set as root, then the uid drops
            argv = ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups"] + (
                argv
            )
        argv = self.limits.wrap(argv)
        self._process = _spawner().submit(_spawn, argv).result()
        return PipeChannel(self._process)

    def _process_count(self) -> int | None:
        return self.limits.process_count()

    def _process_limit_hits(self) -> int | None:
        return self.limits.process_limit_hits()

    def _shell_status(self) -> int | None:
        try:
            return None if self._process is None else self._process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            return None

    def _disk_usage(self) -> DiskUsage | None:
        return disk_usage([h for p, h in self.mounts.items() if p not in self.config.readonly])

    def _kill_processes(self, keep_shell: bool) -> None:
        process = self._process
        if process is None:
            return
        if not keep_shell:
            victims = [process.pid, *descendants(process.pid)]
            victims += [p for p in self.limits.pids() if p not in victims]
            kill(victims)
            self._reap(process)
            return
        # A fork bomb forks between the listing of its processes and their killing, and the
        # children of a killed one live on under the init: the listing is repeated until
        # no process but the shell is left (each round leaves fewer that can fork).
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            tree = descendants(process.pid)
            # the outer bwrap, its pid-1 init and the shell (the init's only child) stay
            init = tree[0] if tree else None
            shell = children(init)[:1] if init else []
            victims = [p for p in tree if p not in (init, *shell) and not zombie(p)]
            if not victims:
                return
            kill(victims)
        logger.warning("bwrap sandbox %s: processes still forking after 5 s of kills", process.pid)

    def _reap(self, process: subprocess.Popen[bytes]) -> None:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.warning("bwrap sandbox %s did not exit after SIGKILL", process.pid)
        # the dedicated uid's live processes, or else the cgroups' members
        left = (lambda: processes_of_uid(self.uid)) if os.geteuid() == 0 else self.limits.pids
        kill_until_gone(left, 0.005)
        self._process = None

    def _release(self) -> None:
        self._kill_processes(keep_shell=False)
        self.limits.close()
        remove_tree(self.root)

    # -- files ---------------------------------------------------------------------------
    def write_file(self, path: str, data: bytes | str) -> None:
        self._check_open()
        payload = data.encode() if isinstance(data, str) else data
        host_dir, parts = self._locate(path)
        fd = _open_dir(host_dir, parts[:-1], create=True, uid=self._owner(path))
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            try:
                file_fd = os.open(parts[-1], flags, 0o644, dir_fd=fd)
            except OSError as error:
                raise SandboxError(f"cannot write {path}: {_reason(error)}") from None
            with os.fdopen(file_fd, "wb") as handle:
                if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                    raise SandboxError(f"cannot write {path}: it is not a regular file")
                handle.truncate()
                handle.write(payload)
                if self._owner(path) is not None:
                    os.fchown(handle.fileno(), self.uid, self.uid)
        finally:
            os.close(fd)

    def read_file(self, path: str) -> bytes:
        self._check_open()
        limit = self.config.max_read_mb * 1024 * 1024
        host_dir, parts = self._locate(path)
        fd = _open_dir(host_dir, parts[:-1], create=False, uid=None, shown=path)
        try:
            # O_NONBLOCK: opening a fifo the agent left would wait for a writer forever
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            try:
                file_fd = os.open(parts[-1], flags, dir_fd=fd)
            except OSError as error:
                raise SandboxError(f"cannot read {path}: {_reason(error)}") from None
            with os.fdopen(file_fd, "rb") as handle:
                if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                    raise SandboxError(f"cannot read {path}: it is not a regular file")
                data = handle.read(limit + 1)
        finally:
            os.close(fd)
        if len(data) > limit:
            raise SandboxError(f"{path} is larger than {self.config.max_read_mb} MB")
        return data

    def _locate(self, path: str) -> tuple[Path, list[str]]:
        """The host directory of the mount holding `path`, and the path's parts below it."""
        if not path.startswith("/"):
            path = f"{self._cwd.rstrip('/')}/{path}"
        parts = [p for p in path.split("/") if p and p != "."]
        if ".." in parts:
            raise SandboxError(f"{path}: '..' is not allowed in file paths")
        for mount in sorted(self.mounts, key=len, reverse=True):
            prefix = [p for p in mount.split("/") if p]
            if parts[: len(prefix)] == prefix and len(parts) > len(prefix):
                return self.mounts[mount], parts[len(prefix) :]
        places = ", ".join(self.mounts)
        raise SandboxError(f"{path} is outside the sandbox's files ({places})")

    def _owner(self, path: str) -> int | None:
        writable = not any(path.startswith(m.rstrip("/") + "/") for m in self.config.readonly)
        return self.uid if writable and os.geteuid() == 0 else None

    # -- trees ---------------------------------------------------------------------------
    def _export_tree(self, path: str) -> bytes:
        return pack_directory(self._tree_dir(path), path)

    def _import_tree(self, path: str, archive: bytes) -> None:
        unpack_directory(archive, self._tree_dir(path), self._owner(path.rstrip("/") + "/x"))

    def _tree_dir(self, path: str) -> Path:
        """The host directory of a sandbox directory, reached without following a link."""
        if path.rstrip("/") in self.mounts:
            return self.mounts[path.rstrip("/")]
        host_dir, parts = self._locate(path)
        for depth in range(1, len(parts) + 1):
            if (host_dir.joinpath(*parts[:depth])).is_symlink():
                raise SandboxError(f"{path}: a component is a symbolic link")
        return host_dir.joinpath(*parts)


def _spawn(argv: list[str]) -> subprocess.Popen[bytes]:
    # An explicit, empty environment: bwrap's own init (pid 1 inside) is a fork of bwrap, so
    # `/proc/1/environ` shows whatever bwrap was started with, whatever `--clearenv` does
    # for the shell; the trainer's API keys must not be there.
    return subprocess.Popen(
        argv,
        env={"PATH": _PATH},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
    )


def _spawner() -> ThreadPoolExecutor:
    """The one thread that starts every bwrap of this process. `--die-with-parent` kills a
    sandbox when the *thread* that started it exits, so sandboxes made in short-lived
    threads (pools, rollout workers) are started by this thread, which lives as long as
    the process."""
    global _SPAWNER
    with _SPAWNER_LOCK:
        if _SPAWNER is None:
            _SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bwrap-spawner")
        return _SPAWNER


def _sandbox_uid() -> int:
    """As root, a uid of the sandbox's own (so per-uid limits are its own); else ours."""
    if os.geteuid() != 0:
        return os.geteuid()
    return 200_000 + (os.getpid() % 1000) * 100 + next(_UIDS) % 100


def _open_dir(root: Path, parts: list[str], create: bool, uid: int | None, shown: str = "") -> int:
    """Opens root/parts one component at a time, never following a symbolic link, so a
    link planted by the agent cannot point a host-side read or write outside the sandbox."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    for part in parts:
        try:
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if uid is not None:
                        os.chown(part, uid, uid, dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    pass
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            next_fd = os.open(part, flags, dir_fd=fd)
        except OSError as error:
            os.close(fd)
            raise SandboxError(f"cannot open {shown or part}: {_reason(error)}") from None
        os.close(fd)
        fd = next_fd
    return fd


def _reason(error: OSError) -> str:
    if error.errno == errno.ELOOP:
        return "it is a symbolic link, which is not followed out of the sandbox"
    if error.errno == errno.ENXIO:
        return "it is a fifo (or socket) nobody reads"
    if error.errno == errno.ENOTDIR:
        return "a component is not a directory (symbolic links are not followed)"
    return os.strerror(error.errno or 0).lower()
