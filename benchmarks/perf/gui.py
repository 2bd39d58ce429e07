"""GUI environment latency and throughput: `clawgym/GUI-v0` (Playwright, one shared Chromium
per process, a browser context per env) against MiniWoB++'s own Selenium environment (the
`miniwob` package, a Chromium and a chromedriver per env) on the same tasks and seeds.

    python -m benchmarks.perf.gui [--tasks click-test,enter-text] [--parallel 1,4,8]
                                  [--episodes 3] [--steps 10] [--rounds 2] [--screenshots]
                                  [--observations]

Every env plays `episodes` episodes of `steps` steps, each env on its own thread, all
started together; env i plays task i of `--tasks` (round robin) with page seeds 0, 1, ...
on both sides. A step is a mouse click on the instruction bar at (80, 25): it changes
nothing, so it costs the same on every task and never ends an episode. Both sides observe
text only (MiniWoB's DOM info without its screenshot, clawgym's page rendering);
`--screenshots` adds one env with screenshots on both sides. `--observations` adds
clawgym in each of its observation modes, `observation=dom` the baseline of `screenshot` (a
PNG per page view, for a vision-language policy) and `both`, at each number of envs. Envs
are built before timing starts; the cases run interleaved, `--rounds` times each.

Prints one table: latencies, steps/s and its ratio to Selenium's with as many envs, and
the CPU time a step costs summed over every process involved (Python, drivers, browser,
renderers) with its ratio. On a machine shared with other work, wall-clock figures move
with the load; CPU per step does not, and it bounds steps/s on a dedicated machine.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rich.console import Console
from rich.table import Table

from envs.gui.env import GUIEnv, Observation

STEP_POINT = (80.0, 25.0)
TARGETS = "targets: step p50 <= 100 ms, reset p50 <= 300 ms, steps/s >= 2x Selenium's"


class Driver(Protocol):
    def reset(self, seed: int) -> None: ...
    def step(self) -> None: ...
    def close(self) -> None: ...


class ClawgymDriver:
    """clawgym/GUI-v0 on one task; a step is `click_at` on the instruction bar."""

    def __init__(self, task: str, reuse_page: bool = True, observation: Observation = "dom"):
        self.task_id = f"miniwob/{task}"
        self.env = GUIEnv(tasks=[task], reuse_page=reuse_page, observation=observation)
        self.action = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {
                        "name": "click_at",
                        "arguments": f'{{"x": {STEP_POINT[0]}, "y": {STEP_POINT[1]}}}',
                    },
                }
            ],
        }
        self.reset(0)  # opens its browser context, as the first reset of a run would

    def reset(self, seed: int) -> None:
        self.env.reset(options={"task_id": self.task_id, "page_seed": seed})

    def step(self) -> None:
        _, _, terminated, truncated, _ = self.env.step(self.action)
        if terminated or truncated:
            raise RuntimeError(f"{self.task_id}: a neutral click ended the episode")

    def close(self) -> None:
        self.env.close()


class SeleniumDriver:
    """MiniWoB++'s gymnasium env (Selenium + chromedriver); a step is CLICK_COORDS."""

    def __init__(self, task: str, screenshot: bool = False):
        import gymnasium as gym
        import miniwob  # noqa: F401  (registers the miniwob/ envs)
        import numpy as np

        os.environ.setdefault("MINIWOB_CHROME_BINARY", _which("chromium"))
        os.environ.setdefault("MINIWOB_CHROMEDRIVER", _which("chromedriver"))
        env: Any = gym.make(f"miniwob/{task}-v1")
        self.env = env.unwrapped
        self.screenshot = screenshot
        self.action = self.env.create_action("CLICK_COORDS", coords=np.array(STEP_POINT))

    def reset(self, seed: int) -> None:
        self.env.reset(seed=seed, options={"record_screenshots": self.screenshot})

    def step(self) -> None:
        _, _, terminated, _, _ = self.env.step(self.action)
        if terminated:
            raise RuntimeError("a neutral click ended the episode")

    def close(self) -> None:
        self.env.close()


def _fresh_pages(task: str) -> Driver:
    return ClawgymDriver(task, reuse_page=False)


def _which(name: str) -> str:
    import shutil

    path = shutil.which(name)
    if path is None:
        raise FileNotFoundError(f"{name} not found: run scripts/setup.sh as root")
    return path


@dataclass(frozen=True)
class Result:
    """Latencies (seconds), wall time and CPU time of one case's runs."""

    resets: tuple[float, ...]
    steps: tuple[float, ...]
    wall: float
    cpu: float
    step_count: int

    def __add__(self, other: Result) -> Result:
        return Result(
            self.resets + other.resets,
            self.steps + other.steps,
            self.wall + other.wall,
            self.cpu + other.cpu,
            self.step_count + other.step_count,
        )

    @property
    def steps_per_second(self) -> float:
        return self.step_count / self.wall

    @property
    def cpu_ms_per_step(self) -> float:
        return 1000 * self.cpu / self.step_count


def _percentile(values: tuple[float, ...], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def process_tree_cpu() -> float:
    """CPU seconds used so far by this process and every process below it (browsers,
    drivers, renderers), read from /proc; on a shared machine this, unlike wall time,
    does not depend on what else runs."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0.0)
        todo += children.get(pid, [])
    return total


def run_case(
    make: Callable[[str], Driver], tasks: list[str], envs: int, episodes: int, steps: int
) -> Result:
    """Builds `envs` drivers, then times them playing together on one thread each."""
    drivers: list[Driver | None] = [None] * envs

    def build(i: int) -> None:
        drivers[i] = make(tasks[i % len(tasks)])

    _together([functools.partial(build, i) for i in range(envs)])
    resets: list[float] = []
    step_times: list[float] = []
    lock = threading.Lock()

    def play(driver: Driver) -> None:
        mine_resets, mine_steps = [], []
        for episode in range(episodes):
            started = time.perf_counter()
            driver.reset(episode)
            mine_resets.append(time.perf_counter() - started)
            for _ in range(steps):
                started = time.perf_counter()
                driver.step()
                mine_steps.append(time.perf_counter() - started)
        with lock:
            resets.extend(mine_resets)
            step_times.extend(mine_steps)

    ready = [d for d in drivers if d is not None]
    cpu = process_tree_cpu()
    started = time.perf_counter()
    _together([functools.partial(play, d) for d in ready])
    wall = time.perf_counter() - started
    cpu = process_tree_cpu() - cpu
    _together([d.close for d in ready])
    return Result(tuple(resets), tuple(step_times), wall, cpu, envs * episodes * steps)


def _together(jobs: list[Callable[[], None]]) -> None:
    """Runs jobs on one thread each and re-raises the first failure."""
    errors: list[BaseException] = []

    def guarded(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


_COLUMNS = (
    "case",
    "envs",
    "reset p50 ms",
    "reset p99 ms",
    "step p50 ms",
    "step p99 ms",
    "steps/s",
    "ratio",
    "CPU ms/step",
    "CPU ratio",
)
Case = tuple[str, int, Callable[[str], Driver], str]  # name, envs, driver, role


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="click-test,click-button,enter-text,choose-list")
    parser.add_argument("--parallel", default="1,4,8", help="numbers of envs run together")
    parser.add_argument("--episodes", type=int, default=3, help="episodes per env")
    parser.add_argument("--steps", type=int, default=10, help="steps per episode")
    parser.add_argument("--screenshots", action="store_true", help="add a screenshot case")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs of every case")
    parser.add_argument(
        "--observations",
        action="store_true",
        help="add clawgym's observation modes, dom their baseline",
    )
    args = parser.parse_args()
    tasks = args.tasks.split(",")
    parallel = [int(n) for n in args.parallel.split(",")]
    cases = _cases(parallel, args.screenshots)
    if args.observations:
        cases += _observation_cases(parallel)
    results: list[Result | None] = [None] * len(cases)
    for _ in range(args.rounds):  # interleaved, so a burst of load elsewhere hits every case
        for index, (_, envs, make, _) in enumerate(cases):
            run = run_case(make, tasks, envs, args.episodes, args.steps)
            previous = results[index]
            results[index] = run if previous is None else previous + run
    table = Table(
        title=f"GUI envs on {', '.join(tasks)}: {args.rounds} rounds of {args.episodes} "
        f"episodes x {args.steps} steps per env",
        caption=TARGETS,
    )
    for column in _COLUMNS:
        table.add_column(column, justify="left" if column == "case" else "right")
    _add_rows(table, cases, results)
    Console(width=150).print(table)


def _cases(parallel: list[int], screenshots: bool) -> list[Case]:
    """Every case to run: each env kind at each number of envs, and the screenshot ones."""
    cases: list[Case] = []
    for envs in parallel:
        cases += [
            ("miniwob Selenium env (baseline)", envs, SeleniumDriver, "baseline"),
            ("clawgym GUI-v0", envs, ClawgymDriver, "ours"),
            ("clawgym GUI-v0, reuse_page=False", envs, _fresh_pages, "ours"),
        ]
    if screenshots:
        cases += [
            (
                "miniwob Selenium env + screenshots",
                1,
                lambda t: SeleniumDriver(t, True),
                "baseline",
            ),
            (
                "clawgym GUI-v0 + screenshots",
                1,
                lambda t: ClawgymDriver(t, observation="both"),
                "ours",
            ),
        ]
    return cases


def _observation_cases(parallel: list[int]) -> list[Case]:
    """clawgym's observation modes at each number of envs, DOM-only the baseline."""
    cases: list[Case] = []
    for envs in parallel:
        cases += [
            ("clawgym observation=dom (baseline)", envs, ClawgymDriver, "baseline"),
            (
                "clawgym observation=screenshot",
                envs,
                lambda t: ClawgymDriver(t, observation="screenshot"),
                "ours",
            ),
            (
                "clawgym observation=both",
                envs,
                lambda t: ClawgymDriver(t, observation="both"),
                "ours",
            ),
        ]
    return cases


def _add_rows(table: Table, cases: list[Case], results: list[Result | None]) -> None:
    """A row per case, its ratios against the baseline case before it."""
    baseline = results[0]
    for (name, envs, _, role), result in zip(cases, results, strict=True):
        if result is None or baseline is None:
            raise RuntimeError("a case did not run")
        if role == "baseline":
            baseline = result
        table.add_row(
            name,
            str(envs),
            f"{1000 * statistics.median(result.resets):.0f}",
            f"{1000 * _percentile(result.resets, 0.99):.0f}",
            f"{1000 * statistics.median(result.steps):.1f}",
            f"{1000 * _percentile(result.steps, 0.99):.1f}",
            f"{result.steps_per_second:.1f}",
            f"{result.steps_per_second / baseline.steps_per_second:.2f}x",
            f"{result.cpu_ms_per_step:.1f}",
            f"{baseline.cpu_ms_per_step / result.cpu_ms_per_step:.2f}x",
        )


if __name__ == "__main__":
    main()
