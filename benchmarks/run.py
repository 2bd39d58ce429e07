"""Evaluate policies on held-out task sets and write the leaderboard.

    python -m benchmarks.run suite=smoke policy=tiny
    python -m benchmarks.run suite=arith policy=[smollm2-135m,adapter:runs/my-run@all]
    python -m benchmarks.run suite=full policy=openai:my-model@http://127.0.0.1:8000/v1

Hydra composes the typed config of `benchmarks/leaderboard/config.py`. Every invocation
appends to `out_dir/results.sqlite` (the exact config, task ids, seeds and weight hashes
of each result), keeps its turns in `out_dir/trajectories/<run id>.sqlite`, and rewrites
`out_dir/leaderboard.md` and `out_dir/index.html` from the newest results in the store.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

import envs  # noqa: F401  (registers the clawgym/ environments)
from agents.engines.base import SamplingParams
from agents.store import Store
from benchmarks.leaderboard import report
from benchmarks.leaderboard.config import BenchConfig, policy_specs, register_configs, validate
from benchmarks.leaderboard.engines import Engines
from benchmarks.leaderboard.evaluate import (
    EpisodeRecord,
    Player,
    TaskSetResult,
    model_player,
    play,
    scripted_player,
    summarize,
    task_ids,
)
from benchmarks.leaderboard.policies import PolicySpec, weights_hash
from benchmarks.leaderboard.results import ResultsStore
from benchmarks.leaderboard.suites import TaskSet, load_object, suite

logger = logging.getLogger(__name__)

Job = tuple[PolicySpec, TaskSet, list[str], Player]
"""A policy on a task set: its spec, the task set, the task ids, its player."""


@dataclass(frozen=True)
class BenchmarkRun:
    """What one invocation wrote."""

    run_id: str
    results: tuple[TaskSetResult, ...]
    store: Path
    markdown: Path
    html: Path
    wall_s: float


def benchmark(config: BenchConfig, resolved: dict[str, Any] | None = None) -> BenchmarkRun:
    """Plays every policy on every task set of the suite; writes store, markdown and HTML."""
    validate(config)
    started = time.monotonic()
    out = Path(config.out_dir)
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    specs = policy_specs(config)
    task_sets = suite(config.suite, config.limit)
    ids = {t.name: task_ids(t) for t in task_sets}
    done: list[TaskSetResult] = []
    api_key = config.api_key or os.environ.get("CLAWGYM_BENCH_API_KEY")
    with (
        ResultsStore(out / "results.sqlite") as results,
        Store(out / "trajectories" / f"{run_id}.sqlite") as trajectories,
        Engines(
            config.engine, config.serve, str(out / "proxy" / f"{run_id}.sqlite"), api_key
        ) as engines,
    ):
        results.start_run(run_id, config.suite, resolved or asdict(config), _git_commit())
        for spec in specs:
            views = None if spec.kind == "scripted" else engines.prepare(spec)
            players = [(t, _player(spec, t, views)) for t in task_sets]
            # A task set without a reference agent gets no oracle row.
            jobs: list[Job] = [(spec, t, ids[t.name], p) for t, p in players if p is not None]
            # Task sets play at once: the engine batches their episodes together, so a
            # suite costs about its longest task set, not the sum of all of them.
            with ThreadPoolExecutor(len(task_sets)) as pool:
                played = pool.map(lambda job: _evaluate(config, job, trajectories), jobs)
                for task_set, result, episodes in played:
                    results.add_result(run_id, config.suite, result, episodes)
                    if task_set.exporter:
                        exporter = load_object(task_set.exporter)
                        exporter(out / "exports" / run_id, result, episodes, trajectories)
                    done.append(result)
        results.finish_run(run_id)
        rows = results.latest()
    markdown, page = out / "leaderboard.md", out / "index.html"
    markdown.write_text(report.markdown(rows))
    page.write_text(report.page(rows))
    return BenchmarkRun(
        run_id,
        tuple(done),
        out / "results.sqlite",
        markdown,
        page,
        round(time.monotonic() - started, 1),
    )


def _evaluate(
    config: BenchConfig, job: Job, trajectories: Store
) -> tuple[TaskSet, TaskSetResult, list[EpisodeRecord]]:
    spec, task_set, ids, player = job
    clock = time.monotonic()
    episodes = play(
        task_set,
        ids,
        player,
        trajectories,
        samples=config.samples,
        seed=config.seed,
        sampling=SamplingParams(
            temperature=config.sampling.temperature,
            top_p=config.sampling.top_p,
            max_tokens=config.sampling.max_tokens,
        ),
        concurrency=config.concurrency,
    )
    result = summarize(
        episodes,
        task_set=task_set,
        policy=spec.label,
        kind=spec.kind,
        series=spec.series,
        step=spec.step,
        weights_hash=_hash(spec, task_set),
        wall_s=time.monotonic() - clock,
        samples=config.samples,
    )
    logger.info(
        "%s on %s: success %.2f, score %.3f (%d episodes, %.1fs)",
        spec.label,
        task_set.name,
        result.pass1,
        result.score,
        result.episodes,
        result.wall_s,
    )
    return task_set, result, episodes


def _player(spec: PolicySpec, task_set: TaskSet, views: Any) -> Player | None:
    if spec.kind != "scripted":
        return model_player(views)
    if spec.name == "do-nothing":
        from envs.core import IdleAgent

        return scripted_player(lambda env: IdleAgent())
    oracle = task_set.oracle_factory()
    return None if oracle is None else scripted_player(oracle)


def _hash(spec: PolicySpec, task_set: TaskSet) -> str:
    oracle = load_object(task_set.oracle) if spec.name == "oracle" and task_set.oracle else None
    return weights_hash(spec, oracle)


def _git_commit() -> str | None:
    try:
        found = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() or None


register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    config: BenchConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    resolved = OmegaConf.to_container(cfg, resolve=True)
    run = benchmark(config, resolved if isinstance(resolved, dict) else None)  # type: ignore[arg-type]
    logger.info(
        "run %s: %d results in %.1fs; wrote %s, %s and %s",
        run.run_id,
        len(run.results),
        run.wall_s,
        run.store,
        run.markdown,
        run.html,
    )


if __name__ == "__main__":
    main()
