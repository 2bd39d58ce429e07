"""Tool-call env throughput: reference episodes per second for each task set, and the
grading time per item, against BFCL's checker called directly as the baseline.

    python -m benchmarks.perf.toolcall [--episodes 40] [--sets simple_python,...]

Prints one table; for BFCL single-turn, `ratio` is the env's grading rate (one graded
episode: reset, reply, grade) over the rate of calling BFCL's `ast_checker` directly on the
same replies, measured in the same run.
"""

from __future__ import annotations

import argparse
import copy
import time

from rich.console import Console
from rich.table import Table

from envs.core import run_episode
from envs.toolcall import bfcl
from envs.toolcall.env import ToolCallEnv, ToolCallReferenceAgent

DEFAULT_SETS = (
    "simple_python",
    "parallel_multiple",
    "live_multiple",
    "live_irrelevance",
    "multi_turn_base",
    "multi_turn_miss_func",
    "tau2_retail",
    "tau2_airline",
)


def episodes_per_second(task_set: str, episodes: int) -> float:
    """Reference episodes of a set played per second (sandbox and grading included)."""
    env = ToolCallEnv(tasks=task_set, split="all", max_turns=60)
    agent = ToolCallReferenceAgent(env)
    ids = list(env.tasks)[:episodes]
    run_episode(env, agent, task_id=ids[0])  # imports and caches out of the timing
    started = time.perf_counter()
    for task_id in ids:
        run_episode(env, agent, task_id=task_id)
    elapsed = time.perf_counter() - started
    env.close()
    return len(ids) / elapsed


def checker_direct_per_second(category: str, items: int) -> float:
    """The baseline: BFCL's checker on each item's reference reply, nothing else."""
    cases = [
        (item, [{n: a} for n, a in bfcl.reference_calls(item, category)])
        for item in bfcl.load_category(category)[:items]
    ]
    warm_item, warm_decoded = cases[0]  # imports and caches out of the timing, as above
    bfcl.ast_checker(
        warm_item["function"], copy.deepcopy(warm_decoded), warm_item["answer"], category
    )
    started = time.perf_counter()
    for item, decoded in cases:
        bfcl.ast_checker(item["function"], copy.deepcopy(decoded), item["answer"], category)
    return len(cases) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=40, help="episodes per task set")
    parser.add_argument("--sets", default=",".join(DEFAULT_SETS))
    args = parser.parse_args()
    table = Table(title=f"toolcall: reference episodes, {args.episodes} per set")
    for column in ("task set", "episodes/s", "ms/item", "ratio"):
        table.add_column(column, justify="right" if column != "task set" else "left")
    for task_set in args.sets.split(","):
        baseline = None
        if task_set in bfcl.SINGLE_TURN and "relevance" not in task_set:
            baseline = checker_direct_per_second(task_set, args.episodes)
            _add_row(table, f"{task_set} checker only (baseline)", baseline, baseline)
        _add_row(table, task_set, episodes_per_second(task_set, args.episodes), baseline)
    Console().print(table)


def _add_row(table: Table, name: str, rate: float, baseline: float | None) -> None:
    ratio = f"{rate / baseline:.2f}x" if baseline else "-"
    table.add_row(name, f"{rate:,.1f}", f"{1000 / rate:.2f}", ratio)


if __name__ == "__main__":
    main()
