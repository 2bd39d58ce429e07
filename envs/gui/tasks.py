"""The task set of `clawgym/GUI-v0`: MiniWoB++'s 130 task pages, split for training and
evaluation.

The split lives in `tasks.json` beside this module, so it is data that a reviewer can read
and that never changes with the code. Two things are held out:

- task families: a family's variants (`click-tab-2`, `click-tab-2-hard`, ...) share one
  split, so an evaluation task is never a renamed training task;
- page seeds: a page generates its problem from the seed the environment gives it, and
  training episodes draw seeds from one range, evaluation episodes from another.

The splits are `train` (training families, training seeds), `test` (held-out families,
evaluation seeds) and `test_seen` (training families on evaluation seeds: the same kind of
page, never the same episode).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

TASK_FILE = Path(__file__).with_name("tasks.json")
SPLITS = ("train", "test", "test_seen")
# Which families and which seed range each split draws from.
_SPLIT_SOURCES = {
    "train": ("train", "train"),
    "test": ("test", "test"),
    "test_seen": ("train", "test"),
}


@dataclass(frozen=True)
class GUITask:
    """One MiniWoB++ task page."""

    name: str
    family: str
    split: str
    stateful: bool

    @property
    def task_id(self) -> str:
        return f"miniwob/{self.name}"

    @property
    def page(self) -> str:
        """Path of the task's HTML file, relative to MiniWoB's `html` folder."""
        return f"miniwob/{self.name}.html"


@dataclass(frozen=True)
class TaskSet:
    """The tasks and page seeds of one split."""

    split: str
    tasks: tuple[GUITask, ...]
    seeds: tuple[int, int]

    def by_id(self) -> dict[str, GUITask]:
        return {task.task_id: task for task in self.tasks}


@functools.cache
def _load_file() -> tuple[tuple[GUITask, ...], dict[str, tuple[int, int]]]:
    data = json.loads(TASK_FILE.read_text())
    tasks = tuple(GUITask(**entry) for entry in data["tasks"])
    seeds = {name: (int(low), int(high)) for name, (low, high) in data["seeds"].items()}
    return tasks, seeds


def all_tasks() -> tuple[GUITask, ...]:
    """Every task of the task set, in both splits."""
    return _load_file()[0]


def load_split(split: str, names: tuple[str, ...] | None = None) -> TaskSet:
    """The tasks and seed range of a split, optionally narrowed to some task names.

    Raises:
        ValueError: for an unknown split, or a name that is not in the split.
    """
    if split not in _SPLIT_SOURCES:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    family_split, seed_split = _SPLIT_SOURCES[split]
    tasks, seeds = _load_file()
    chosen = tuple(task for task in tasks if task.split == family_split)
    if names is not None:
        known = {task.name for task in chosen}
        missing = sorted(set(names) - known)
        if missing:
            raise ValueError(f"tasks not in split {split!r}: {', '.join(missing)}")
        chosen = tuple(task for task in chosen if task.name in set(names))
    return TaskSet(split, chosen, seeds[seed_split])


def split_of(name: str) -> str:
    """The family split (`train` or `test`) a task name belongs to."""
    for task in all_tasks():
        if task.name == name:
            return task.split
    raise ValueError(f"no MiniWoB task named {name!r}")
