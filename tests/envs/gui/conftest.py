"""Shared GUI fixtures: real Chromium environments, opened once per module."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from envs.gui.env import GUIEnv


def call(name: str, **arguments) -> dict:
    """An assistant message with one tool call."""
    return calls((name, arguments))


def calls(*pairs: tuple[str, dict]) -> dict:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in enumerate(pairs)
        ],
    }


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def chromium_browser_pids() -> list[int]:
    """This test process's Chromium browser processes (not its renderers or helpers)."""
    pids = []
    for pid in descendants(os.getpid()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"chrom" in cmdline[0] and b"--type=" not in b" ".join(cmdline):
            pids.append(pid)
    return pids


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def gui_env():
    env = GUIEnv(
        tasks=["click-test", "enter-text", "choose-list", "click-checkboxes", "scroll-text"]
    )
    yield env
    env.close()
