"""Task sets of the terminal env, with a held-out split each.

- "tbench": tasks in the terminal-bench directory format, shipped in `envs/terminal/tasks/`;
  any other directory in that format is loaded the same way (pass its path).
  A task is a directory holding `task.yaml` (`instruction`, optional `max_agent_timeout_sec`,
  `max_test_timeout_sec`, `workdir`), a reference solution (`solution.sh`, or `solution.yaml`
  listing `{command: ...}` steps), `tests/` run by pytest (through `run-tests.sh` when the
  task has one), and optionally `setup.sh`, which stands in for the Dockerfile's build steps
  (images are never pulled here) and runs in the sandbox before the agent starts. A task
  folder is untrusted input, as a Harbor one is: a symbolic link in it may point only
  inside it (`check_links`), and its timeouts must be finite numbers of seconds up to
  `MAX_TIMEOUT_SEC` (`seconds`).
- "harbor": the same tasks as Harbor task folders (terminal-bench 2.0's format), converted
  from the shipped ones on first use (`harbor.shipped_harbor`); "harbor:PATH" loads any
  folder of Harbor task folders (see `harbor.py`, which builds on this module).
- "icalfa": InterCode-ALFA's 300 natural-language-to-bash tasks, read from the installed
  `icalfa` package's data files (its code, which needs scikit-learn and Docker, is not
  imported), each with the file-system setup script of its image and its gold command.

Every fifth task (by position in a set) is held out as the "test" split; `env.load_task_set`
picks a set by name.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

SPLITS = ("train", "test", "all")
_DOCKER_ENV = re.compile(r'^ENV (\w+)="?([^"\n]*)"?$', re.MULTILINE)
SHIPPED = Path(__file__).resolve().parent / "tasks"
MAX_TIMEOUT_SEC = 86_400.0
"""The bound of every timeout a task folder sets (task.yaml's, task.toml's): a day."""
# InterCode-ALFA's five file-system images: how many tasks each holds, in order.
ICALFA_IMAGES = (153, 49, 57, 23, 18)
# The directories InterCode-ALFA's setup scripts create (its images track every
# non-system top-level directory with git); here they are the writable places.
ICALFA_ROOTS = ("/testbed", "/system", "/workspace", "/backup", "/index")
DEFAULT_TEST_COMMAND = (
    "cd /tests && PYTHONDONTWRITEBYTECODE=1 python3 -m pytest -p no:cacheprovider -rA "
    "--confcutdir=/tests /tests"
)


@dataclass(frozen=True)
class TerminalTask:
    """One terminal task, whichever set it comes from.

    Attributes:
        task_id: "tbench/<name>" or "icalfa/<index>".
        kind: "tbench" (graded by its tests) or "icalfa" (graded against its gold command).
        instruction: what the agent is asked to do.
        setup: bash run in the sandbox before the episode.
        solution: the reference solution (bash); for icalfa, the gold command.
        workdir: the shell's starting directory.
        writable: directories the agent may write.
        tests: (path under /tests, content) of each test file (tbench).
        test_command: bash that runs the tests (tbench).
        test_timeout: seconds the tests may run.
        command_timeout: seconds one agent command may run.
        env: environment variables of the task's shell.
        environment: a Harbor task's `environment/` folder (its Dockerfile is built for the
            Docker backend); empty for the other kinds.
    """

    task_id: str
    kind: str
    instruction: str
    setup: str
    solution: str
    workdir: str
    writable: tuple[str, ...]
    tests: tuple[tuple[str, str], ...] = ()
    test_command: str = DEFAULT_TEST_COMMAND
    test_timeout: float = 120.0
    command_timeout: float = 30.0
    env: tuple[tuple[str, str], ...] = ()
    environment: str = ""


def select_split(tasks: list[TerminalTask], split: str) -> dict[str, TerminalTask]:
    """The tasks of one split: every fifth task is "test", the rest "train"."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    chosen = {
        t.task_id: t
        for index, t in enumerate(tasks)
        if split == "all" or (index % 5 == 4) == (split == "test")
    }
    if not chosen:
        raise ValueError(f"the {split!r} split of this task set is empty; add tasks or use 'all'")
    return chosen


# -- terminal-bench format ------------------------------------------------------------------
@functools.cache
def load_tbench(directory: str) -> tuple[TerminalTask, ...]:
    """Every task directory (one holding `task.yaml`) under `directory`, sorted by name."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"task set {directory!r} is neither 'tbench', 'icalfa' nor a directory")
    tasks = [load_tbench_task(path.parent) for path in sorted(root.glob("*/task.yaml"))]
    if not tasks:
        raise ValueError(f"no task directories (with a task.yaml) in {directory}")
    return tuple(tasks)


def load_tbench_task(path: Path) -> TerminalTask:
    """One task directory in the terminal-bench format; raises ValueError for a link that
    leaves it or a timeout that is not finite and bounded (`check_links`, `seconds`)."""
    check_links(path, "terminal-bench task")
    meta: dict[str, Any] = yaml.safe_load((path / "task.yaml").read_text()) or {}
    if not isinstance(meta.get("instruction"), str):
        raise ValueError(f"{path / 'task.yaml'} has no instruction")
    test_dir = path / "tests"
    tests = tuple(
        (str(file.relative_to(test_dir)), file.read_text())
        for file in sorted(test_dir.rglob("*"))
        if file.is_file() and "__pycache__" not in file.parts
    )
    if not tests:
        raise ValueError(f"{path} has no tests/ directory with tests")
    runner = path / "run-tests.sh"
    if runner.exists():
        tests += (("run-tests.sh", runner.read_text()),)
    workdir, where = str(meta.get("workdir", "/app")), f"{path / 'task.yaml'}:"
    seconds(meta.get("max_agent_timeout_sec", 300), f"{where} max_agent_timeout_sec")
    return TerminalTask(
        task_id=f"tbench/{path.name}",
        kind="tbench",
        instruction=meta["instruction"].strip(),
        setup=_read(path / "setup.sh"),
        solution=_solution(path),
        workdir=workdir,
        writable=(workdir,),
        tests=tests,
        test_command="cd /tests && bash /tests/run-tests.sh"
        if runner.exists()
        else DEFAULT_TEST_COMMAND,
        test_timeout=seconds(
            meta.get("max_test_timeout_sec", 120), f"{where} max_test_timeout_sec"
        ),
        command_timeout=seconds(
            meta.get("max_command_timeout_sec", 30), f"{where} max_command_timeout_sec"
        ),
    )


def check_links(path: Path, what: str) -> None:
    """Raises ValueError when the task folder `path` (`what`: its format, for the message)
    is a symbolic link or holds one whose target, followed through every link of a chain,
    is outside the folder."""
    if path.is_symlink():
        raise ValueError(f"{what} {path} is a symbolic link; a task folder must be a folder")
    root = path.resolve()
    for folder, directories, files in os.walk(path):  # never descends into linked folders
        for name in directories + files:
            entry = Path(folder, name)
            if entry.is_symlink() and not _inside(entry, root):
                raise ValueError(
                    f"{what} {path}: {entry.relative_to(path)} is a symbolic link to "
                    f"{os.readlink(entry)}, which leaves the task folder (or loops); links "
                    "must stay inside it"
                )


def _inside(link: Path, root: Path) -> bool:
    """Whether `link`, followed through every link of its chain, ends inside `root`."""
    try:
        return link.resolve().is_relative_to(root)
    except (RuntimeError, OSError):  # a loop of links
        return False


def seconds(value: Any, where: str) -> float:
    """A timeout read from a task folder: a finite number of seconds in (0, MAX_TIMEOUT_SEC],
    else a ValueError naming `where` (the file and field), the value and the bound."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_SEC:
        raise ValueError(
            f"{where} must be a positive number of seconds, finite and at most "
            f"{MAX_TIMEOUT_SEC:g}; got {value!r}"
        )
    return float(value)


def _solution(path: Path) -> str:
    if (path / "solution.sh").exists():
        return (path / "solution.sh").read_text()
    if (path / "solution.yaml").exists():
        steps = yaml.safe_load((path / "solution.yaml").read_text()) or []
        return "\n".join(str(step["command"]) for step in steps)
    raise ValueError(f"{path} has no solution.sh or solution.yaml")


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


# -- InterCode-ALFA -------------------------------------------------------------------------
def icalfa_dir() -> Path:
    """Where the `icalfa` package's data lives (found without importing it)."""
    spec = importlib.util.find_spec("icalfa")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the icalfa task set needs the 'icalfa' package: pip install --no-deps icalfa==0.3.6 "
            "(scripts/setup.sh does)"
        )
    return Path(list(spec.submodule_search_locations)[0])


@functools.cache
def load_icalfa() -> tuple[TerminalTask, ...]:
    """InterCode-ALFA's 300 tasks, in the package's order (ids icalfa/000 ... icalfa/299)."""
    assets = icalfa_dir() / "assets"
    tasks: list[TerminalTask] = []
    for image, expected in enumerate(ICALFA_IMAGES, start=1):
        items = json.loads((assets / "datasets" / f"nl2bash_fs_{image}.json").read_text())
        if len(items) != expected:
            raise ValueError(f"icalfa image {image} has {len(items)} tasks, not {expected}")
        setup = (assets / "docker" / f"setup_nl2b_fs_{image}.sh").read_text()
        dockerfile = (assets / "docker" / f"nl2bash{image}.Dockerfile").read_text()
        env = tuple((k, v) for k, v in _DOCKER_ENV.findall(dockerfile))
        for item in items:
            tasks.append(
                TerminalTask(
                    task_id=f"icalfa/{len(tasks):03d}",
                    kind="icalfa",
                    instruction=str(item["query"]),
                    setup=setup,
                    solution=str(item["gold"]),
                    workdir="/",
                    writable=ICALFA_ROOTS,
                    command_timeout=10.0,
                    env=env,
                )
            )
    return tuple(tasks)
