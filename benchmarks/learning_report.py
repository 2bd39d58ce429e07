"""The learning benchmark's comparison (`benchmarks.learning`): each method's held-out
preference score by step with its 95% interval, its difference from the first method, and
the policy's entropy and KL to its start by step, as one table and one plot.

A run's record (what `benchmarks.learning` keeps per method and seed, JSON):
`{"method", "seed", "wall_s", "held_out": [{"step", "scores", "on_topic"}], "training":
[{"step", "entropy", "kl_to_start", "judge_score", "distill_tokens"}]}`, `held_out` with
one score and one on-topic flag per held-out task, the same tasks in the same order at
every step and in every run (step 0: the base model).

Intervals: the held-out tasks are the sample, the seeds repeat the training: each task's
score is first averaged over the seeds, then the mean over tasks gets a percentile-bootstrap
interval (`trainers.stats.bootstrap_interval`), and a difference between two methods is the
paired one, task by task.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from trainers.stats import bootstrap_interval
from trainers.stats import mean as mean_or_nan


@dataclass(frozen=True)
class StepScore:
    """One method's held-out figures at one step, over its seeds."""

    method: str
    step: int
    seeds: int
    score: float
    low: float
    high: float
    """The 95% interval of `score`, over tasks."""
    on_topic: float
    guarded: float
    """The score with off-topic replies counted as 0."""
    difference: float | None
    """`score` minus the first method's at the same step, paired by task (None: the first
    method itself, or a step it was not scored at)."""
    difference_low: float | None
    difference_high: float | None
    entropy: float | None
    kl_to_start: float | None
    judge_score: float | None
    """The step's training figures (its row of metrics.jsonl), averaged over the seeds;
    None at step 0 or where a run reports none."""


def task_means(runs: Sequence[Sequence[float]]) -> list[float]:
    """Each task's value averaged over runs (one list per run, tasks in the same order).

    Raises:
        ValueError: runs scored different numbers of tasks.
    """
    if not runs:
        return []
    if len({len(run) for run in runs}) != 1:
        raise ValueError(f"runs scored different task counts: {[len(r) for r in runs]}")
    return [sum(values) / len(values) for values in zip(*runs, strict=True)]


def guarded_scores(scores: Sequence[float], on_topic: Sequence[bool]) -> list[float]:
    """Scores with each off-topic reply's counted as 0 (a reply that says nothing cannot
    meet a preference this way)."""
    return [s if topical else 0.0 for s, topical in zip(scores, on_topic, strict=True)]


def mean_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """The mean of `values` and its 95% bootstrap interval."""
    low, high = bootstrap_interval(values)
    return mean_or_nan(values), low, high


def paired_difference(
    values: Sequence[float], reference: Sequence[float]
) -> tuple[float, float, float]:
    """The mean task-by-task difference `values - reference` and its 95% interval."""
    return mean_interval([v - r for v, r in zip(values, reference, strict=True)])


def _held_out_at(run: dict[str, Any], step: int) -> dict[str, Any] | None:
    return next((h for h in run["held_out"] if h["step"] == step), None)


def _training_mean(runs: Sequence[dict[str, Any]], step: int, key: str) -> float | None:
    values = [
        row[key]
        for run in runs
        for row in run["training"]
        if row["step"] == step and row.get(key) is not None
    ]
    return sum(values) / len(values) if values else None


def step_scores(runs: Sequence[dict[str, Any]], methods: Sequence[str]) -> list[StepScore]:
    """Every method's `StepScore` at each step its runs were all scored at, in the order of
    `methods`; differences are to `methods[0]`."""
    per_task: dict[tuple[str, int], list[float]] = {}
    scored: list[tuple[str, int, list[dict[str, Any]], list[dict[str, Any]]]] = []
    for method in methods:
        mine = [r for r in runs if r["method"] == method]
        steps = sorted({h["step"] for r in mine for h in r["held_out"]})
        for step in steps:
            found = [_held_out_at(r, step) for r in mine]
            if any(h is None for h in found):
                continue  # a seed not scored there: no like-for-like figure
            held = [h for h in found if h is not None]
            per_task[method, step] = task_means([h["scores"] for h in held])
            scored.append((method, step, mine, held))
    results = []
    for method, step, mine, held in scored:
        scores = per_task[method, step]
        score, low, high = mean_interval(scores)
        guarded = task_means([guarded_scores(h["scores"], h["on_topic"]) for h in held])
        topical = task_means([[float(t) for t in h["on_topic"]] for h in held])
        reference = per_task.get((methods[0], step))
        difference: tuple[float | None, float | None, float | None] = (None, None, None)
        if method != methods[0] and reference is not None:
            difference = paired_difference(scores, reference)
        results.append(
            StepScore(
                method=method,
                step=step,
                seeds=len(held),
                score=score,
                low=low,
                high=high,
                on_topic=mean_or_nan(topical),
                guarded=mean_or_nan(guarded),
                difference=difference[0],
                difference_low=difference[1],
                difference_high=difference[2],
                entropy=_training_mean(mine, step, "entropy"),
                kl_to_start=_training_mean(mine, step, "kl_to_start"),
                judge_score=_training_mean(mine, step, "judge_score"),
            )
        )
    return results


def _number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _signed(value: float | None, low: float | None, high: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:+.3f} [{low:+.3f}, {high:+.3f}]"


def comparison_table(title: str, scores: Sequence[StepScore], reference: str) -> Table:
    """The one table: a row per method and scored step."""
    table = Table(title=title)
    columns = ("method", "step", "seeds", "preference [95%]", f"vs {reference} [95%]")
    for column in (*columns, "on-topic", "guarded", "entropy", "KL to start", "judge score"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for s in scores:
        table.add_row(
            s.method,
            str(s.step),
            str(s.seeds),
            f"{s.score:.3f} [{s.low:.3f}, {s.high:.3f}]",
            _signed(s.difference, s.difference_low, s.difference_high),
            _number(s.on_topic, 2),
            _number(s.guarded),
            _number(s.entropy),
            _number(s.kl_to_start, 4),
            _number(s.judge_score, 2),
        )
    return table


def plot(scores: Sequence[StepScore], runs: Sequence[dict[str, Any]], path: Path) -> None:
    """Preference by step with its interval band; entropy and KL to start by training step
    (every step, averaged over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (preference, entropy, kl) = plt.subplots(1, 3, figsize=(15, 4))
    for method in dict.fromkeys(s.method for s in scores):
        mine = [s for s in scores if s.method == method]
        steps = [s.step for s in mine]
        line = preference.plot(steps, [s.score for s in mine], marker="o", label=method)[0]
        preference.fill_between(
            steps, [s.low for s in mine], [s.high for s in mine], color=line.get_color(), alpha=0.2
        )
        ran = [r for r in runs if r["method"] == method]
        trained = sorted({row["step"] for r in ran for row in r["training"]})
        for axis, key in ((entropy, "entropy"), (kl, "kl_to_start")):
            values = [_training_mean(ran, step, key) for step in trained]
            axis.plot(trained, [math.nan if v is None else v for v in values], label=method)
    preference.set_ylabel("held-out preference score (95% interval)")
    entropy.set_ylabel("policy entropy (nats)")
    kl.set_ylabel("KL to the start (k3)")
    for axis in (preference, entropy, kl):
        axis.set_xlabel("step")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
