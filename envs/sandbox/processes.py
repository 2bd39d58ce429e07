"""Host-side views of a sandbox's processes, read from /proc: who they are, whose children,
whether alive, and the kills that end them (as a fork bomb forks between a listing and its
kill, `kill_until_gone` lists and kills again until none is left)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path


def processes_of_uid(uid: int) -> set[int]:
    """Live processes of `uid` (zombies, already dead and awaiting their reaper, are not)."""
    found = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    stat = Path(entry.path, "stat").read_text()
                    if stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                        found.add(int(entry.name))
            except (OSError, IndexError):
                continue
    return found


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def zombie(pid: int) -> bool:
    """Whether a process is dead and waits for its parent (or is gone): none to kill."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] in ("Z", "X")


def kill(pids: Iterable[int]) -> None:
    """SIGKILLs each of `pids` that still exists."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_until_gone(listing: Callable[[], Iterable[int]], pause: float) -> None:
    """Kills what `listing` returns, again every `pause` seconds, until it returns nothing
    or for 5 seconds at most (processes may fork while they are being killed)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = list(listing())
        if not left:
            break
        kill(left)
        time.sleep(pause)


def descendants(pid: int) -> list[int]:
    """Every descendant of `pid`, parents before children."""
    found: list[int] = []
    frontier = [pid]
    while frontier:
        born = [c for p in frontier for c in children(p)]
        found += born
        frontier = born
    return found


def process_start_time(pid: int) -> str:
    """When process `pid` started (clock ticks since boot), "" if there is none: with the
    pid it names a process, as pids are reused."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""
