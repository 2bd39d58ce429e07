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
from agents.trajectory import BROKE_OFF, SessionStatus
from envs.core import solved
from trainers.config import EvalConfig
from trainers.metrics import MetricsWriter
from trainers.stats import wilson_interval

logger = logging.getLogger(__name__)

EVAL_SEED = 1_000_003
"""Seed of every evaluation episode: the same tasks played the same way at every step."""

SAMPLE_KEY = "eval_sample"
"""A pass@k sample's index in its session's metadata (greedy episodes have none)."""


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
    """Episodes that broke off (a refused request, an env or a server that failed)."""
    k: int = 0
    """Samples per task at the run's temperature for pass@k; 0: none were drawn."""
    pass_at_k: float | None = None
    """Share of tasks solved by at least one of their k samples."""
    pass_at_k_low: float | None = None
    pass_at_k_high: float | None = None
    """The 95% Wilson interval of pass@k (over tasks)."""
    sampled_pass_at_1: float | None = None
    """Share of the tasks whose first sample solved them: pass@1 at the run's temperature,
    as the rollouts see the policy (the greedy pass@1 is `pass_at_1`). The first sample
    only, since a task's later samples are played only until one solves it."""


def score(
    step: int,
    summaries: list[EpisodeSummary],
    samples: Sequence[Sequence[EpisodeSummary]] = (),
    k: int | None = None,
) -> EvalScore:
    """The held-out score of one env's evaluation episodes (a success: its full reward,
    `envs.core.solved`, the leaderboard's rule): `summaries` greedy, one per task, and
    `samples` each task's sampled episodes in their order (none: no pass@k), k drawn for
    each (None: as many as the longest list has). A task's list may stop at its first
    success: the samples after it cannot change whether one of k solved the task."""
    successes = sum(solved(s.total_reward) for s in summaries)
    n = len(summaries)
    low, high = wilson_interval(successes, n)
    result = EvalScore(
        step=step,
        episodes=n,
        successes=successes,
        pass_at_1=round(successes / n, 6) if n else 0.0,
        low=round(low, 6),
        high=round(high, 6),
        reward=round(sum(s.total_reward for s in summaries) / n, 6) if n else 0.0,
        failed=sum(s.status in BROKE_OFF for s in summaries),
    )
    if not samples or not all(samples):
        return result
    k = k or max(len(task) for task in samples)
    reached = sum(any(solved(s.total_reward) for s in task[:k]) for task in samples)
    first_solved = sum(solved(task[0].total_reward) for task in samples)
    k_low, k_high = wilson_interval(reached, len(samples))
    return dataclasses.replace(
        result,
        k=k,
        # k samples drawn for pass@k: Chen et al.'s estimator is then whether any passed
        pass_at_k=round(reached / len(samples), 6),
        pass_at_k_low=round(k_low, 6),
        pass_at_k_high=round(k_high, 6),
        sampled_pass_at_1=round(first_solved / len(samples), 6),
    )


def eval_row(result: EvalScore) -> dict[str, Any]:
    """An evaluation's row of metrics.jsonl (its step is the row's): `eval_<field>`."""
    return {f"eval_{k}": v for k, v in dataclasses.asdict(result).items() if k != "step"}


def score_of(row: Mapping[str, Any]) -> EvalScore:
    """The evaluation a metrics.jsonl row (`eval_row`'s, with its step) records; fields a
    row lacks (written before they existed) take their defaults."""
    names = [f.name for f in dataclasses.fields(EvalScore) if f.name != "step"]
    found = {name: row[f"eval_{name}"] for name in names if f"eval_{name}" in row}
    return EvalScore(step=int(row["step"]), **found)


def evenly_spaced(ids: list[str], count: int) -> list[str]:
    """`count` of `ids`, evenly spaced over them (all of them when there are no more):
    task ids are grouped by kind (BFCL's by category, Terminal's by source), so the first
    few would test one kind only."""
    if count >= len(ids):
        return list(ids)
    return [ids[i * len(ids) // count] for i in range(count)]


class FirstSolved:
    """The lowest sample index known to have solved each task, shared by an evaluation's
    threads (a dict's reads and writes are atomic under the GIL; a lost race only means
    a sample played that need not have been)."""

    def __init__(self) -> None:
        self.lowest: dict[str, int] = {}

    def see(self, task_id: str, sample: int | None, summary: EpisodeSummary) -> None:
        """Notes a finished pass@k sample (greedy episodes, sample None, do not count)."""
        if sample is not None and solved(summary.total_reward):
            self.lowest[task_id] = min(sample, self.lowest.get(task_id, sample))

    def settled(self, task_id: str, sample: int | None) -> bool:
        """Whether a sample of a lower index has solved the task, so this one cannot change
        whether one of k did."""
        return sample is not None and self.lowest.get(task_id, sample) < sample


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
        self.sample_sampling = sampling
        """The run's own sampling, for the pass@k samples."""
        self.pass_k = {
            name: env.group_size if config.pass_k is None else config.pass_k
            for name, env in envs.items()
        }
        """Samples per held-out task for pass@k, by env (below 2: none)."""
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
        self.switch_step: int | None = None
        """The step at which imitation (a warm start's supervised steps) handed over to RL,
        set by the pipeline that runs it; None: no warm start."""

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

    def evaluate(
        self, step: int, version: int | None = None, between: bool = False
    ) -> dict[str, EvalScore]:
        """Plays the held-out tasks of every env not yet evaluated at `step` with the
        policy as it is after `step` steps, served as policy version `version` (None: not
        known, and nothing is taken back from the store); returns their scores. `between`:
        an evaluation every `eval.every` steps, not the before, the switch or the after,
        whose pass@k samples `eval.pass_k_at` may leave out ("every")."""
        scores = {
            name: self._evaluate_env(name, step, version, between)
            for name in self.makers
            if all(run.step != step for run in self.history[name])
        }
        if not scores:
            return scores
        for name, result in scores.items():
            self.history[name].append(result)
            sampled = (
                ""
                if result.pass_at_k is None
                else f", pass@{result.k} {result.pass_at_k:.3f} [{result.pass_at_k_low:.3f}, "
                f"{result.pass_at_k_high:.3f}], sampled pass@1 {result.sampled_pass_at_1:.3f}"
            )
            logger.info(
                "eval at step %d, %s: pass@1 %.3f [%.3f, %.3f] over %d%s, reward %.3f",
                step,
                name,
                result.pass_at_1,
                result.low,
                result.high,
                result.episodes,
                sampled,
                result.reward,
            )
            if self.metrics is not None:
                self.metrics.write(step, eval_row(result), env=name)
        self._plot()
        return scores

    def before_after(self) -> dict[str, dict[str, Any]]:
        """Each env's evaluation before training (None with `eval.before` off), at the
        switch from imitation to RL (`switch_step`; None without a warm start), and its
        last (the summary's before, switch and after), and every evaluation's pass@1 and
        pass@k (`curve`: step, pass@1, pass@k or None)."""
        return {
            name: {
                "before": dataclasses.asdict(runs[0]) if runs[0].step == 0 else None,
                "switch": next(
                    (dataclasses.asdict(r) for r in runs if r.step == self.switch_step), None
                ),
                "after": dataclasses.asdict(runs[-1]),
                "curve": [(r.step, r.pass_at_1, r.pass_at_k) for r in runs],
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
        self, name: str, version: int | None, task_ids: Sequence[str], sample: int | None = None
    ) -> dict[str, EpisodeSummary]:
        """The evaluation episodes of env `name` on `task_ids` that policy version `version`
        played to their end (done or truncated; a failed one is played again), as
        `EpisodeSummary`s by task id, the last of each: the greedy ones, or (`sample`) the
        pass@k samples of that index."""
        if self.store is None or version is None:
            return {}
        wanted = set(task_ids)
        ended = (SessionStatus.DONE, SessionStatus.TRUNCATED)
        found: dict[str, EpisodeSummary] = {}
        for stored in self.store.sessions():  # oldest first: a task's last play is kept
            if stored.env_id != f"eval/{name}" or stored.task_id not in wanted:
                continue
            if stored.status not in ended or stored.metadata.get(SAMPLE_KEY) != sample:
                continue
            session = self.store.session(stored.session_id)
            if session.turns and all(t.policy_version == version for t in session.turns):
                found[stored.task_id] = EpisodeSummary.of(session)
        return found

    def occasion(self, step: int, between: bool) -> str:
        """Which of the run's evaluations (`EVALUATIONS`) one at `step` is."""
        if step == 0:
            return "before"
        if step == self.switch_step:
            return "switch"
        return "every" if between else "after"

    def _evaluate_env(
        self, name: str, step: int, version: int | None, between: bool = False
    ) -> EvalScore:
        task_ids = self.held_out_tasks(name)
        k = self.pass_k[name] if self.pass_k[name] > 1 else 0
        if self.occasion(step, between) not in self.config.pass_k_at:
            k = 0
        # every episode of the evaluation in one pool: a batching engine decodes them together
        kinds: list[int | None] = [None, *range(k)]
        done = self._play(name, step, version, [(t, kind) for kind in kinds for t in task_ids])
        greedy = [done[t, None] for t in task_ids]
        samples = [[done[t, j] for j in range(k) if (t, j) in done] for t in task_ids]
        return score(step, greedy, samples if k else [], k)

    def _play(
        self, name: str, step: int, version: int | None, jobs: list[tuple[str, int | None]]
    ) -> dict[tuple[str, int | None], EpisodeSummary]:
        """One episode per (task id, sample): greedy (sample None), or the pass@k sample of
        that index at the run's temperature with a seed of its own; episodes this policy
        version played to their end before a stop are taken back from the store. A sample
        is not played once a sample of a lower index has solved its task (`FirstSolved`):
        pass@k comes out the same, and an evaluation of a policy that solves most tasks
        plays a fraction of its samples."""
        taken_back: dict[tuple[str, int | None], EpisodeSummary] = {}
        for sample in dict.fromkeys(kind for _, kind in jobs):
            tasks = [t for t, kind in jobs if kind == sample]
            found = self.played(name, version, tasks, sample)
            taken_back |= {(t, sample): summary for t, summary in found.items()}
        if taken_back:
            logger.info(
                "eval at step %d, %s: %d of %d episodes were played by policy version %s "
                "before the run stopped; playing the other %d",
                step,
                name,
                len(taken_back),
                len(jobs),
                version,
                len(jobs) - len(taken_back),
            )
        first_solved = FirstSolved()
        for (task_id, sample), summary in taken_back.items():
            first_solved.see(task_id, sample, summary)

        def play(job: tuple[str, int | None]) -> EpisodeSummary | None:
            if first_solved.settled(*job):
                return None
            summary = self._play_one(name, *job)
            first_solved.see(*job, summary)
            return summary

        # in order: every greedy episode, then each task's sample 0, 1, ... (a pool takes
        # jobs first come, first served, so lower samples start first and may settle later)
        remaining = [job for job in jobs if job not in taken_back]
        workers = min(self.config.parallel, len(remaining)) or 1
        with ThreadPoolExecutor(workers, f"eval-{name}") as pool:
            results = dict(zip(remaining, pool.map(play, remaining), strict=True))
        played = {job: summary for job, summary in results.items() if summary is not None}
        if len(played) < len(remaining):
            logger.info(
                "eval at step %d, %s: %d pass@k samples not played (an earlier sample of "
                "their task solved it)",
                step,
                name,
                len(remaining) - len(played),
            )
        return taken_back | played

    def _play_one(self, name: str, task_id: str, sample: int | None) -> EpisodeSummary:
        """One evaluation episode of env `name`: greedy (sample None), or the pass@k sample
        of that index, at the run's temperature with a seed of its own."""
        if sample is None:
            sampling = sampling_params(self.sampling, EVAL_SEED)
        else:
            sampling = sampling_params(self.sample_sampling, EVAL_SEED + 1 + sample)
        max_tokens = self.config.max_tokens or self.max_tokens[name]
        if max_tokens is not None:
            sampling = dataclasses.replace(sampling, max_tokens=max_tokens)
        env = self.makers[name]()
        try:
            return run_episode(
                env,
                self.seat,
                env_id=f"eval/{name}",
                task_id=task_id,
                seed=EVAL_SEED,
                sampling=sampling,
                metadata={} if sample is None else {SAMPLE_KEY: sample},
            )
        finally:
            env.close()

    def _plot(self) -> None:
        """Draws every env's greedy pass@1 (with its interval) and pass@k against the step,
        with the switch from imitation to RL marked, to eval.png."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(7, 4.5))
        for name, runs in self.history.items():
            steps = [r.step for r in runs]
            (line,) = axes.plot(
                steps, [r.pass_at_1 for r in runs], marker="o", label=f"{name} pass@1 (greedy)"
            )
            axes.fill_between(steps, [r.low for r in runs], [r.high for r in runs], alpha=0.2)
            sampled = [(r.step, r.pass_at_k, r.k) for r in runs if r.pass_at_k is not None]
            if sampled:
                axes.plot(
                    [step for step, _, _ in sampled],
                    [value for _, value, _ in sampled],
                    marker="s",
                    linestyle="--",
                    color=line.get_color(),
                    label=f"{name} pass@{sampled[-1][2]} (temperature)",
                )
        if self.switch_step is not None:
            axes.axvline(self.switch_step, color="grey", linestyle=":", label="imitation -> RL")
        axes.set_xlabel("step")
        axes.set_ylabel("held-out success (95% Wilson interval)")
        axes.set_ylim(0, 1)
        axes.legend(fontsize="small")
        figure.tight_layout()
        figure.savefig(self.run_dir / "eval.png")
        plt.close(figure)
