"""Held-out evaluation during training: before the first step (unless `eval.before` is off),
every `eval.every` steps and after the last, each env of the run plays `eval.episodes` (or
its own `eval_episodes`) held-out tasks (its kwargs with `eval_kwargs`, the test split by
default) greedily, and each env's pass@1 (with its Wilson interval) and mean reward are
logged per env and plotted (`eval.png`).

Evaluation episodes reach the policy through the proxy like every rollout, as side turns
(`X-Turn-Type: side`) of sessions labelled `eval/<env>`: they are stored, so what was
evaluated can be read back, but never judged or trained. A resumed run reads its earlier
evaluations back from metrics.jsonl: its "before" is its first process's, and no step is
evaluated twice. An evaluation that a stopped run left half played takes back, from the
store, the episodes that the same policy version played to their end, and plays only the
rest: a version's weights are checkpointed before it is served, so the same version is the
same policy.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym

from agents.compose import sampling_params
from agents.config import EnvConfig, SamplingConfig
from agents.rollout import EpisodeSummary, Seat, run_episode
from agents.store import Store
from agents.trajectory import SessionStatus
from envs.core import solved
from trainers.config import EvalConfig
from trainers.metrics import MetricsWriter
from trainers.stats import wilson_interval

logger = logging.getLogger(__name__)

EVAL_SEED = 1_000_003
"""Seed of every evaluation episode: the same tasks played the same way at every step."""

_MAX_PARALLEL = 8


@dataclass(frozen=True)
class EvalScore:
    """One env's held-out score at one step."""

    step: int
    episodes: int
    successes: int
    pass_at_1: float
    low: float
    high: float
    """The 95% Wilson interval of pass@1."""
    reward: float
    """Mean total reward (the env's own score where it is not pass / fail)."""
    failed: int
    """Episodes that broke off (a refused request, an env that failed)."""


def score(step: int, summaries: list[EpisodeSummary]) -> EvalScore:
    """The held-out score of one env's evaluation episodes (a success: its full reward,
    `envs.core.solved`, the leaderboard's rule)."""
    successes = sum(solved(s.total_reward) for s in summaries)
    n = len(summaries)
    low, high = wilson_interval(successes, n)
    return EvalScore(
        step=step,
        episodes=n,
        successes=successes,
        pass_at_1=round(successes / n, 6) if n else 0.0,
        low=round(low, 6),
        high=round(high, 6),
        reward=round(sum(s.total_reward for s in summaries) / n, 6) if n else 0.0,
        failed=sum(s.status == SessionStatus.FAILED for s in summaries),
    )


def eval_row(result: EvalScore) -> dict[str, Any]:
    """An evaluation's row of metrics.jsonl (its step is the row's): `eval_<field>`."""
    return {f"eval_{k}": v for k, v in dataclasses.asdict(result).items() if k != "step"}


def score_of(row: Mapping[str, Any]) -> EvalScore:
    """The evaluation a metrics.jsonl row (`eval_row`'s, with its step) records."""
    names = [f.name for f in dataclasses.fields(EvalScore) if f.name != "step"]
    return EvalScore(step=int(row["step"]), **{name: row[f"eval_{name}"] for name in names})


def evenly_spaced(ids: list[str], count: int) -> list[str]:
    """`count` of `ids`, evenly spaced over them (all of them when there are no more):
    task ids are grouped by kind (BFCL's by category, Terminal's by source), so the first
    few would test one kind only."""
    if count >= len(ids):
        return list(ids)
    return [ids[i * len(ids) // count] for i in range(count)]


class Evaluator:
    """Plays each env's held-out tasks greedily and records their scores.

    Args:
        config: the evaluation's config.
        envs: the run's simulated envs, by name.
        make_env: makes one instance of an env config (`agents.compose.env_factory`).
        seat: where the episodes reach the policy; its turns must be side turns.
        sampling: the run's sampling (temperature is set to 0 here).
        metrics: where each evaluation's rows go.
        run_dir: where `eval.png` is drawn.
        store: the run's store, where an evaluation stopped halfway finds the episodes it
            already played (None: every evaluation plays all its episodes).
    """

    def __init__(
        self,
        config: EvalConfig,
        envs: Mapping[str, EnvConfig],
        make_env: Callable[[EnvConfig], Callable[[], gym.Env[Any, Any]]],
        seat: Seat,
        sampling: SamplingConfig,
        metrics: MetricsWriter | None,
        run_dir: Path,
        store: Store | None = None,
    ):
        self.config, self.seat, self.metrics, self.run_dir = config, seat, metrics, Path(run_dir)
        self.store = store
        self.sampling = dataclasses.replace(sampling, temperature=0.0)
        self.episodes = {
            name: config.episodes if env.eval_episodes is None else env.eval_episodes
            for name, env in envs.items()
        }
        self.makers = {
            name: make_env(dataclasses.replace(env, kwargs={**env.kwargs, **env.eval_kwargs}))
            for name, env in envs.items()
            if self.episodes[name] > 0
        }
        self.max_tokens = {name: env.max_tokens for name, env in envs.items()}
        self.history: dict[str, list[EvalScore]] = {name: [] for name in self.makers}

    @property
    def enabled(self) -> bool:
        return bool(self.makers)

    def due(self, step: int) -> bool:
        """Whether step `step` (just finished) is an evaluation step besides the last."""
        return self.enabled and self.config.every > 0 and step % self.config.every == 0

    @property
    def started(self) -> bool:
        """Whether every env has an evaluation (a resumed run's "before" is its first's)."""
        return self.enabled and all(self.history.values())

    def restore(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Takes back the evaluations recorded in metrics.jsonl (`records`, the `eval_`
        rows of this run's earlier processes), so that a resumed run neither forgets its
        "before" nor plays a step's evaluation twice."""
        self.history = {name: [] for name in self.makers}
        for row in records:
            if row.get("env") in self.history and "eval_pass_at_1" in row:
                self.history[row["env"]].append(score_of(row))

    def evaluate(self, step: int, version: int | None = None) -> dict[str, EvalScore]:
        """Plays the held-out tasks of every env not yet evaluated at `step` with the
        policy as it is after `step` steps, served as policy version `version` (None: not
        known, and nothing is taken back from the store); returns their scores."""
        scores = {
            name: self._evaluate_env(name, step, version)
            for name in self.makers
            if all(run.step != step for run in self.history[name])
        }
        if not scores:
            return scores
        for name, result in scores.items():
            self.history[name].append(result)
            logger.info(
                "eval at step %d, %s: pass@1 %.3f [%.3f, %.3f] over %d, reward %.3f",
                step,
                name,
                result.pass_at_1,
                result.low,
                result.high,
                result.episodes,
                result.reward,
            )
            if self.metrics is not None:
                self.metrics.write(step, eval_row(result), env=name)
        self._plot()
        return scores

    def before_after(self) -> dict[str, dict[str, Any]]:
        """Each env's evaluation before training (None with `eval.before` off) and its
        last (the summary's before and after), and pass@1 at every evaluation (`curve`:
        step, pass@1)."""
        return {
            name: {
                "before": dataclasses.asdict(runs[0]) if runs[0].step == 0 else None,
                "after": dataclasses.asdict(runs[-1]),
                "curve": [(r.step, r.pass_at_1) for r in runs],
            }
            for name, runs in self.history.items()
            if runs
        }

    def held_out_tasks(self, name: str) -> list[str]:
        """The task ids env `name` plays at every evaluation, in order."""
        probe = self.makers[name]()
        try:
            every_id = sorted(probe.unwrapped.task_ids())  # type: ignore[attr-defined]
        finally:
            probe.close()
        return evenly_spaced(every_id, self.episodes[name])

    def played(
        self, name: str, version: int | None, task_ids: Sequence[str]
    ) -> dict[str, EpisodeSummary]:
        """The evaluation episodes of env `name` on `task_ids` that policy version `version`
        played to their end (done or truncated; a failed one is played again), as
        `EpisodeSummary`s by task id, the last of each."""
        if self.store is None or version is None:
            return {}
        wanted = set(task_ids)
        ended = (SessionStatus.DONE, SessionStatus.TRUNCATED)
        found: dict[str, EpisodeSummary] = {}
        for stored in self.store.sessions():  # oldest first: a task's last play is kept
            if stored.env_id != f"eval/{name}" or stored.task_id not in wanted:
                continue
            if stored.status not in ended:
                continue
            session = self.store.session(stored.session_id)
            if session.turns and all(t.policy_version == version for t in session.turns):
                found[stored.task_id] = EpisodeSummary.of(session)
        return found

    def _evaluate_env(self, name: str, step: int, version: int | None) -> EvalScore:
        make = self.makers[name]
        task_ids = self.held_out_tasks(name)
        taken_back = self.played(name, version, task_ids)
        if taken_back:
            logger.info(
                "eval at step %d, %s: %d of %d episodes were played by policy version %s "
                "before the run stopped; playing the other %d",
                step,
                name,
                len(taken_back),
                len(task_ids),
                version,
                len(task_ids) - len(taken_back),
            )
        sampling = sampling_params(self.sampling, EVAL_SEED)
        max_tokens = self.config.max_tokens or self.max_tokens[name]
        if max_tokens is not None:
            sampling = dataclasses.replace(sampling, max_tokens=max_tokens)

        def play(task_id: str) -> EpisodeSummary:
            env = make()
            try:
                return run_episode(
                    env,
                    self.seat,
                    env_id=f"eval/{name}",
                    task_id=task_id,
                    seed=EVAL_SEED,
                    sampling=sampling,
                )
            finally:
                env.close()

        remaining = [t for t in task_ids if t not in taken_back]
        with ThreadPoolExecutor(min(_MAX_PARALLEL, len(remaining)) or 1, f"eval-{name}") as pool:
            played = dict(zip(remaining, pool.map(play, remaining), strict=True))
        return score(step, [taken_back.get(t) or played[t] for t in task_ids])

    def _plot(self) -> None:
        """Draws every env's pass@1 (with its interval) against the step, to eval.png."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(6, 4))
        for name, runs in self.history.items():
            steps = [r.step for r in runs]
            axes.plot(steps, [r.pass_at_1 for r in runs], marker="o", label=name)
            axes.fill_between(steps, [r.low for r in runs], [r.high for r in runs], alpha=0.2)
        axes.set_xlabel("step")
        axes.set_ylabel("held-out pass@1 (95% Wilson interval)")
        axes.set_ylim(0, 1)
        axes.legend()
        figure.tight_layout()
        figure.savefig(self.run_dir / "eval.png")
        plt.close(figure)
