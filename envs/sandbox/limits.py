"""Resource limits of a process tree on the host: cgroups where this process may create
them (v1 controllers, or v2 with the controllers delegated), rlimits everywhere.

`HostLimits.wrap(argv)` returns a command line that joins the sandbox's cgroups, sets its
rlimits with util-linux `prlimit` and then runs `argv`; `close()` removes the cgroups.
`disk_usage` measures a sandbox's files from the host; `cgroups_named` and
`remove_cgroups` let a reaper find and remove the cgroups of sandboxes whose owner died.
Nothing here runs at import time.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from envs.sandbox.processes import kill_until_gone
from envs.sandbox.records import DiskUsage, SandboxConfig

logger = logging.getLogger(__name__)

# Processes RLIMIT_NPROC allows beyond a pids cgroup's limit (see HostLimits._nproc).
_NPROC_SLACK = 16
_JOIN = 'for f; do [ "$f" = -- ] && { shift; break; }; echo $$ >"$f"; shift; done; exec "$@"'


@dataclass(frozen=True)
class _Group:
    """One cgroup directory and the limit files written into it."""

    path: Path
    settings: tuple[tuple[str, str], ...]


def _mounts() -> dict[str, Path]:
    """cgroup controller (or "unified") -> the directory this process belongs to."""
    mounts: dict[str, Path] = {}
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text().splitlines()
        membership = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return mounts
    roots: dict[str, Path] = {}
    for line in mountinfo:
        left, _, right = line.partition(" - ")
        fstype, _, options = right.split(" ")[:3]
        point = Path(left.split(" ")[4])
        if fstype == "cgroup2":
            roots["unified"] = point
        elif fstype == "cgroup":
            for option in options.split(","):
                roots.setdefault(option, point)
    for line in membership:
        number, controllers, path = line.split(":", 2)
        names = ["unified"] if number == "0" else controllers.split(",")
        for name in names:
            if name in roots:
                mounts[name] = roots[name] / path.lstrip("/")
    return mounts


def _cgroups(config: SandboxConfig, name: str) -> list[_Group]:
    """The cgroups to create for one sandbox, for the controllers this host offers."""
    mounts = _mounts()
    memory = str(config.memory_mb * 1024 * 1024)
    quota = str(int(config.cpus * 100_000))
    groups: list[_Group] = []
    settings: tuple[tuple[str, str], ...]
    if "memory" in mounts:
        settings = (("memory.limit_in_bytes", memory),)
        groups.append(_Group(mounts["memory"] / name, settings))
    if "pids" in mounts:
        groups.append(_Group(mounts["pids"] / name, (("pids.max", str(config.max_procs)),)))
    if "cpu" in mounts:
        settings = (("cpu.cfs_period_us", "100000"), ("cpu.cfs_quota_us", quota))
        groups.append(_Group(mounts["cpu"] / name, settings))
    if not groups and "unified" in mounts:
        settings = (
            ("memory.max", memory),
            ("memory.swap.max", "0"),
            ("pids.max", str(config.max_procs)),
            ("cpu.max", f"{quota} 100000"),
        )
        groups.append(_Group(mounts["unified"] / name, settings))
    return groups


class HostLimits:
    """The limits of one sandbox's process tree: created by `__init__`, removed by `close`.

    Args:
        config: the sandbox's limits.
        name: a name unique to the sandbox (its cgroups' directory name).
        uid: the host uid the sandbox runs as; rlimits on processes count per uid.
    """

    def __init__(self, config: SandboxConfig, name: str, uid: int):
        self.config = config
        self.uid = uid
        self.groups: list[_Group] = []
        if os.geteuid() == 0:
            self.groups = [g for g in _cgroups(config, name) if _create(g)]

    @property
    def cgroup_dirs(self) -> list[Path]:
        return [group.path for group in self.groups]

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run inside the cgroups and under the rlimits."""
        memory = self.config.memory_mb * 1024 * 1024
        prlimit = [
            shutil.which("prlimit") or "prlimit",
            f"--nproc={self._nproc()}",
            # Address space well above the memory limit: runtimes reserve more than they use.
            f"--as={4 * memory}",
            f"--cpu={self.config.cpu_seconds}",
            f"--fsize={self.config.max_file_mb * 1024 * 1024}",
            "--core=0",
            "--",
        ]
        if not self.groups:
            return [*prlimit, *argv]
        procs = [str(g.path / "cgroup.procs") for g in self.groups]
        return ["/bin/sh", "-c", _JOIN, "sh", *procs, "--", *prlimit, *argv]

    def _nproc(self) -> int:
        """RLIMIT_NPROC counts every process of the uid: a dedicated uid gets the sandbox's
        own allowance, a shared one (not root) its current processes on top. Beside a pids
        cgroup the rlimit is a backstop a little above it, so that the cgroup's limit, whose
        refusals the kernel counts (`process_limit_hits`), is the one a fork bomb meets."""
        allowance = self.config.max_procs + (_NPROC_SLACK if self._pids_group() else 0)
        if os.geteuid() == 0:
            return allowance
        return allowance + _processes_of(self.uid)

    def _pids_group(self) -> _Group | None:
        """The cgroup that holds the process limit, if the sandbox has one."""
        return next((g for g in self.groups if any(k == "pids.max" for k, _ in g.settings)), None)

    def pids(self) -> set[int]:
        """Host pids of every process in the sandbox's cgroups."""
        found: set[int] = set()
        for group in self.groups:
            try:
                text = (group.path / "cgroup.procs").read_text()
            except OSError:
                continue
            found.update(int(p) for p in text.split())
        return found

    def process_count(self) -> int | None:
        """Tasks (processes and threads) in the sandbox's pids cgroup, if it has one."""
        for group in self.groups:
            for name in ("pids.current",):
                try:
                    return int((group.path / name).read_text())
                except (OSError, ValueError):
                    continue
        return None

    def process_limit_hits(self) -> int | None:
        """Forks refused at the sandbox's process limit so far, if it has a pids cgroup."""
        group = self._pids_group()
        return None if group is None else refused_forks(group.path)

    def close(self) -> None:
        """Removes the cgroups (their processes must have ended)."""
        for group in self.groups:
            try:
                group.path.rmdir()
            except OSError as error:
                logger.warning("cannot remove cgroup %s: %s", group.path, error)
        self.groups = []


def _create(group: _Group) -> bool:
    try:
        group.path.mkdir()
        for key, value in group.settings:
            (group.path / key).write_text(value)
    except OSError as error:
        logger.debug("cgroup %s unavailable: %s", group.path, error)
        try:
            group.path.rmdir()
        except OSError:
            pass
        return False
    return True


def _processes_of(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                continue
    return count


def disk_usage(paths: Sequence[Path]) -> DiskUsage:
    """What the trees at `paths` take on disk: allocated blocks (a file with several links
    counts once) and entries, the roots included. Walked in this process, which costs tens
    of microseconds for a small tree; a tree that a walk by path cannot take (a path past
    PATH_MAX, a directory swapped for a link while walked) is left to find(1)."""
    try:
        return _walk(paths)
    except _Unwalkable as error:
        logger.debug("walking by path failed (%s); find(1) measures", error)
        return _find(paths)


class _Unwalkable(Exception):
    """A tree that `_walk` cannot measure by path."""


def _walk(paths: Sequence[Path]) -> DiskUsage:
    """`disk_usage` by path, with a list rather than recursion (a tree may be thousands of
    levels deep). A directory is entered only if it is the very one listed (same device and
    inode, opened without following a link), so a link the agent swaps in meanwhile cannot
    lead the walk out of the tree."""
    blocks = files = 0
    linked: set[tuple[int, int]] = set()
    pending: list[tuple[str, tuple[int, int] | None]] = [(str(p), None) for p in paths]
    while pending:
        path, identity = pending.pop()
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (FileNotFoundError, PermissionError):
            continue  # deleted since it was listed, or made unreadable (find could not either)
        except OSError as error:
            raise _Unwalkable(f"{path[:80]}...: {error.strerror}") from None
        try:
            here = os.fstat(fd)
            if identity is None:
                files, blocks = files + 1, blocks + here.st_blocks
            elif (here.st_dev, here.st_ino) != identity:
                raise _Unwalkable(f"{path[:80]}... changed while walked")
            with os.scandir(fd) as entries:
                for entry in entries:
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    files += 1
                    if stat.S_ISDIR(info.st_mode):
                        if info.st_dev == here.st_dev:
                            pending.append((f"{path}/{entry.name}", (info.st_dev, info.st_ino)))
                    elif info.st_nlink > 1:
                        if (info.st_dev, info.st_ino) in linked:
                            continue
                        linked.add((info.st_dev, info.st_ino))
                    blocks += info.st_blocks
        finally:
            os.close(fd)
    return DiskUsage(bytes=blocks * 512, files=files)


def _find(paths: Sequence[Path], timeout: float = 60.0) -> DiskUsage:
    """`disk_usage` by find(1), which works from directory descriptors: no link followed,
    no tree too deep. Past `timeout` (millions of files) what was counted so far is
    returned."""
    existing = [str(path) for path in paths if path.is_dir()]
    if not existing:
        return DiskUsage(bytes=0, files=0)
    command = ["find", *existing, "-xdev", "-printf", "%n %b %D:%i\\n"]
    try:
        output = subprocess.run(command, capture_output=True, timeout=timeout).stdout
    except subprocess.TimeoutExpired as error:
        logger.warning("measuring %s took over %.0f s", existing, timeout)
        output = error.stdout or b""
    blocks = files = 0
    linked: set[bytes] = set()
    for line in output.splitlines():
        links, size, inode = line.split(b" ")
        files += 1
        if links != b"1":  # a directory, or a file with other names: count its blocks once
            if inode in linked:
                continue
            linked.add(inode)
        blocks += int(size)
    return DiskUsage(bytes=blocks * 512, files=files)


def _controller_dirs() -> list[Path]:
    """The directories `_cgroups` makes a sandbox's cgroups in."""
    mounts = _mounts()
    dirs = [mounts[name] for name in ("memory", "pids", "cpu") if name in mounts]
    return dirs or ([mounts["unified"]] if "unified" in mounts else [])


def cgroups_named(prefix: str) -> dict[str, list[Path]]:
    """Name -> directories of every cgroup whose name starts with `prefix`, among those
    this process can make (a sandbox has one per controller)."""
    found: dict[str, list[Path]] = {}
    for parent in _controller_dirs():
        try:
            entries = list(parent.glob(f"{prefix}*"))
        except OSError:
            continue
        for path in entries:
            found.setdefault(path.name, []).append(path)
    return found


def remove_cgroups(paths: Sequence[Path]) -> None:
    """Kills every process in the cgroups (for a few seconds, as they may fork) and removes
    them."""
    kill_until_gone(lambda: _members(paths), 0.01)
    for path in paths:
        try:
            path.rmdir()
        except FileNotFoundError:
            pass  # another reaper was first
        except OSError as error:
            logger.warning("cannot remove cgroup %s: %s", path, error)


def _members(paths: Sequence[Path]) -> set[int]:
    """The processes in the cgroups at `paths`."""
    members: set[int] = set()
    for path in paths:
        try:
            members.update(int(p) for p in (path / "cgroup.procs").read_text().split())
        except OSError:
            continue
    return members


def refused_forks(group: Path) -> int | None:
    """The `max` count of a pids cgroup's `pids.events` (v1 and v2 alike): how many forks
    its limit refused. None where the file cannot be read."""
    try:
        lines = (group / "pids.events").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(" ")
        if key == "max" and value.strip().isdigit():
            return int(value)
    return None
