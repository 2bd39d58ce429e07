"""Plays a policy on a task set: episodes run concurrently through the training agent loop
(`agents.rollout.run_episode`) into a trajectory store, then reduce to one result row.

Every policy plays the same task ids with the same seeds (a seed is a hash of the task
set, task id and sample index), so differences between rows are paired comparisons.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import gymnasium as gym

from agents.engines.base import SamplingParams
from agents.rollout import run_episode
from agents.seats import DirectSeat
from agents.store import Store
from benchmarks.leaderboard.engines import EpisodeRecorder, EpisodeView, ScriptedEngine
from benchmarks.leaderboard.suites import EpisodeTrace, TaskSet
from trainers import stats

logger = logging.getLogger(__name__)

_INFO_CHARS = 200_000
"""Bound on a stored info: a page view or a log in an info must not bloat the store."""

ViewFactory = Callable[[], EpisodeView]
Player = Callable[[EpisodeRecorder], EpisodeView | ScriptedEngine]
"""Builds the engine one episode plays with, given its (reset-to-be) env."""


@dataclass(frozen=True)
class EpisodeRecord:
    """One episode of one policy on one task."""

    task_id: str
    sample: int
    seed: int
    success: bool
    score: float
    reward: float
    turns: int
    tokens_in: int
    tokens_out: int
    seconds: float
    session_id: str | None
    error: str | None
    info: str = "{}"
    """The env's last info, merged over the episode as JSON (exporters read it: a SWE
    env's patch, for instance)."""


@dataclass(frozen=True)
class TaskSetResult:
    """A policy on a task set: the leaderboard's row (confidence intervals are 95%)."""

    task_set: str
    env_id: str
    policy: str
    kind: str
    series: str | None
    step: int | None
    weights_hash: str
    tasks: int
    episodes: int
    successes: int
    errors: int
    pass1: float
    pass1_lo: float
    pass1_hi: float
    k: int
    pass_k: float
    score: float
    score_lo: float
    score_hi: float
    reward: float
    reward_lo: float
    reward_hi: float
    turns: float
    tokens_in: float
    tokens_out: float
    episode_s: float
    wall_s: float


def seed_of(base: int, task_set: str, task_id: str, sample: int) -> int:
    """A stable 31-bit episode seed (Python's `hash` changes between processes)."""
    text = f"{base}/{task_set}/{task_id}/{sample}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:4], "big") >> 1


def scripted_player(build: Callable[[Any], Any]) -> Player:
    """A player of scripted agents; `build(env)` makes one episode's agent."""
    return lambda recorder: ScriptedEngine(lambda: build(recorder.unwrapped), recorder)


def model_player(views: ViewFactory) -> Player:
    return lambda recorder: views()


def task_ids(task_set: TaskSet) -> list[str]:
    """The task ids a task set evaluates (opens one env to ask)."""
    env = gym.make(task_set.env_id, **task_set.env_kwargs())
    try:
        return task_set.select(list(env.unwrapped.task_ids()))  # type: ignore[attr-defined]
    finally:
        env.close()


def play(
    task_set: TaskSet,
    ids: Sequence[str],
    player: Player,
    store: Store,
    *,
    samples: int,
    seed: int,
    sampling: SamplingParams,
    concurrency: int,
) -> list[EpisodeRecord]:
    """Plays `samples` episodes of every task id, `concurrency` at a time."""
    envs: list[EpisodeRecorder] = []
    lock = threading.Lock()

    def episode(job: tuple[str, int]) -> EpisodeRecord:
        with lock:
            recorder = envs.pop() if envs else None
        if recorder is None:
            recorder = EpisodeRecorder(gym.make(task_set.env_id, **task_set.env_kwargs()))
        try:
            return _episode(task_set, recorder, player, store, job, seed, sampling)
        finally:
            with lock:
                envs.append(recorder)

    jobs = [(task_id, sample) for task_id in ids for sample in range(samples)]
    try:
        with ThreadPoolExecutor(max(1, min(concurrency, len(jobs)))) as pool:
            return list(pool.map(episode, jobs))
    finally:
        for recorder in envs:
            recorder.close()


def _episode(
    task_set: TaskSet,
    recorder: EpisodeRecorder,
    player: Player,
    store: Store,
    job: tuple[str, int],
    seed: int,
    sampling: SamplingParams,
) -> EpisodeRecord:
    task_id, sample = job
    episode_seed = seed_of(seed, task_set.name, task_id, sample)
    engine = player(recorder)
    started = time.monotonic()
    session_id, error = None, None
    try:
        summary = run_episode(
            recorder,
            DirectSeat(engine, store),
            env_id=task_set.env_id,
            task_id=task_id,
            seed=episode_seed,
            group_id=f"{task_set.name}/{task_id}",
            sampling=SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                seed=episode_seed,
            ),
        )
        session_id, error = summary.session_id, summary.error
    except Exception as exc:  # a failed episode is data: it counts, as a failure
        logger.warning("episode %s of %s failed: %r", task_id, task_set.name, exc)
        error = f"{type(exc).__name__}: {exc}"[:500]
    trace = EpisodeTrace(
        task_id,
        tuple(recorder.rewards),
        tuple(recorder.infos),
        recorder.terminated,
        recorder.truncated,
    )
    outcome = task_set.score(trace)
    return EpisodeRecord(
        task_id=task_id,
        sample=sample,
        seed=episode_seed,
        success=outcome.success and error is None,
        score=outcome.score,
        reward=trace.reward,
        turns=len(recorder.rewards),
        tokens_in=engine.prompt_tokens,
        tokens_out=engine.completion_tokens,
        seconds=round(time.monotonic() - started, 3),
        session_id=session_id,
        error=error,
        info=json.dumps(recorder.info, default=str)[:_INFO_CHARS],
    )


def summarize(
    records: Sequence[EpisodeRecord],
    *,
    task_set: TaskSet,
    policy: str,
    kind: str,
    series: str | None,
    step: int | None,
    weights_hash: str,
    wall_s: float,
    samples: int,
) -> TaskSetResult:
    """One result row from a policy's episodes on a task set."""
    by_task: dict[str, list[EpisodeRecord]] = defaultdict(list)
    for record in records:
        by_task[record.task_id].append(record)
    successes = sum(r.success for r in records)
    n = len(records)
    low, high = stats.wilson_interval(successes, n)
    # Intervals of means resample tasks, not episodes: samples of one task are correlated.
    task_scores = [stats.mean([r.score for r in rs]) for rs in by_task.values()]
    task_rewards = [stats.mean([r.reward for r in rs]) for rs in by_task.values()]
    score_ci = stats.bootstrap_interval(task_scores)
    reward_ci = stats.bootstrap_interval(task_rewards)
    pass_k = stats.mean(
        [stats.pass_at_k(len(rs), sum(r.success for r in rs), samples) for rs in by_task.values()]
    )
    return TaskSetResult(
        task_set=task_set.name,
        env_id=task_set.env_id,
        policy=policy,
        kind=kind,
        series=series,
        step=step,
        weights_hash=weights_hash,
        tasks=len(by_task),
        episodes=n,
        successes=successes,
        errors=sum(r.error is not None for r in records),
        pass1=successes / n if n else math.nan,
        pass1_lo=low,
        pass1_hi=high,
        k=samples,
        pass_k=pass_k,
        score=stats.mean(task_scores),
        score_lo=score_ci[0],
        score_hi=score_ci[1],
        reward=stats.mean(task_rewards),
        reward_lo=reward_ci[0],
        reward_hi=reward_ci[1],
        turns=stats.mean([r.turns for r in records]),
        tokens_in=stats.mean([r.tokens_in for r in records]),
        tokens_out=stats.mean([r.tokens_out for r in records]),
        episode_s=stats.mean([r.seconds for r in records]),
        wall_s=round(wall_s, 2),
    )
