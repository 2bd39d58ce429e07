"""What is left to free when a sandbox ends, in one place: the resources an environment
holds (`close_held`), a sandbox's host directory (`remove_tree`), and the sandboxes of
owners that died without closing them: bwrap roots and cgroups (`reap_bwrap_orphans`) and
docker containers (`reap_docker_orphans`), told apart by their owner's pid and start time,
as pids are reused."""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from envs.sandbox.limits import cgroups_named, remove_cgroups
from envs.sandbox.processes import process_start_time

logger = logging.getLogger(__name__)

BWRAP_PREFIX = "clawgym-bwrap-"  # sandbox roots are the prefix + "<pid>-<start time>-<random>"
LABEL = "clawgym.sandbox"
OWNER_LABEL = "clawgym.owner"


def close_held(owner: object, name: str) -> None:
    """Takes what `owner.name` holds (a sandbox, or what holds sandboxes) away, leaving None,
    and closes it if there was one: an environment's reset and close share this, and
    whatever the close does, nothing uses the old resource after it began."""
    resource = getattr(owner, name)
    setattr(owner, name, None)
    if resource is not None:
        resource.close()


def remove_tree(root: Path) -> None:
    """Removes a sandbox's host directory whatever the agent made of it: `rm` walks a
    thousand-level tree that `shutil.rmtree` meets with a `RecursionError`, and the
    permissions it took away (chmod 000) are given back first where we are not root."""
    if not root.exists():
        return
    command = ["rm", "-rf", "--one-file-system", "--", str(root)]
    if subprocess.run(command, capture_output=True, check=False).returncode != 0:
        subprocess.run(["chmod", "-R", "u+rwx", "--", str(root)], capture_output=True, check=False)
        result = subprocess.run(command, capture_output=True, check=False)
        if result.returncode != 0:
            logger.warning("cannot remove %s: %s", root, result.stderr.decode(errors="replace"))


def reap_bwrap_orphans() -> list[str]:
    """Removes the bwrap sandbox roots (in the temporary directory) and cgroups whose
    owning process is gone, killing what still runs in those cgroups first; returns their
    names. Owners are processes of this machine's pid namespace, as those sharing its /tmp
    are."""
    prefix = BWRAP_PREFIX
    roots = {path.name: path for path in Path(tempfile.gettempdir()).glob(f"{prefix}*")}
    groups = cgroups_named(prefix)
    orphans = sorted(name for name in roots.keys() | groups.keys() if not _owner_alive(name))
    for name in orphans:
        remove_cgroups(groups.get(name, []))
        if name in roots and roots[name].is_dir() and not roots[name].is_symlink():
            remove_tree(roots[name])
    if orphans:
        logger.info("reaped %d orphaned bwrap sandboxes", len(orphans))
    return orphans


def _owner_alive(name: str) -> bool:
    """Whether the process that made the sandbox root or cgroup `name` still runs: its pid,
    and its start time where the name has one (older names had only the pid)."""
    fields = name[len(BWRAP_PREFIX) :].split("-")
    if not fields[0].isdigit():
        return True  # not a name of ours: left alone
    started = process_start_time(int(fields[0]))
    return started != "" and (len(fields) < 3 or fields[1] == started)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def owner_label() -> str:
    """Who owns a container: this boot, this pid and its start time (pids are reused)."""
    pid = os.getpid()
    return f"{_boot_id()}:{pid}:{process_start_time(pid)}"


def reap_docker_orphans(client: Any) -> list[str]:
    """Removes clawgym containers whose owning process is gone; returns their names."""
    removed = []
    for container in client.containers.list(all=True, filters={"label": LABEL}):
        boot, _, rest = container.labels.get(OWNER_LABEL, "::").partition(":")
        pid_text, _, started = rest.partition(":")
        alive = (
            boot == _boot_id()
            and pid_text.isdigit()
            and started != ""
            and process_start_time(int(pid_text)) == started
        )
        if boot == _boot_id() and not alive:
            try:
                container.remove(force=True)
                removed.append(container.name)
            except Exception as error:  # already gone, or being removed by its owner
                logger.debug("reaper: cannot remove %s: %s", container.name, error)
    if removed:
        logger.info("reaped %d orphaned sandbox containers", len(removed))
    return removed
