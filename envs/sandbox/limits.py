"""Resource limits of a process tree on the host: cgroups where this process may create
them (v1 controllers, or v2 with the controllers delegated), rlimits everywhere.

`HostLimits.wrap(argv)` returns a command line that joins the sandbox's cgroups, sets its
rlimits with util-linux `prlimit` and then runs `argv`; `close()` removes the cgroups.
Nothing here runs at import time.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from envs.sandbox.base import SandboxConfig

logger = logging.getLogger(__name__)

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
        own allowance, a shared one (not root) its current processes on top."""
        if os.geteuid() == 0:
            return self.config.max_procs
        return self.config.max_procs + _processes_of(self.uid)

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
