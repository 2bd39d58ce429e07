"""A run's live counters, overall and per env, and the pure summaries of them that become
per-env rows of `metrics.jsonl`, the progress bar and `summary.json`.

The loops append to these from their threads; readers (the progress bar) only read plain
numbers and lists, which needs no lock under the GIL.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from envs.core import solved
from trainers.learning import StepMetrics


@dataclass(frozen=True)
class EpisodeRecord:
    """One finished episode, as its env's metrics count it."""

    reward: float
    """The episode's total environment reward."""
    turns: int
    completion_tokens: int
    wall_s: float
    status: str
    """done, truncated or failed."""
    reason: str | None = None
    """Why a truncated or failed episode ended."""
    replay: bool = False
    """Whether it replayed a task an earlier group played (`rollout.replay_informative`)."""

    @property
    def success(self) -> bool:
        """Whether the episode solved its task (`envs.core.solved`: its full reward)."""
        return solved(self.reward)


@dataclass
class EnvProgress:
    """One env's episodes and the training-side counts of its turns."""

    episodes: list[EpisodeRecord] = field(default_factory=list)
    reported: int = 0
    """How many of `episodes` earlier metrics rows covered."""
    turns_trained: int = 0
    turns_dropped: int = 0

    def unreported(self) -> list[EpisodeRecord]:
        """The episodes finished since the last row, marked reported."""
        end = len(self.episodes)
        fresh, self.reported = self.episodes[self.reported : end], end
        return fresh

    @property
    def mean_recent_reward(self) -> float:
        window = self.episodes[-32:]
        return sum(e.reward for e in window) / len(window) if window else 0.0


@dataclass
class Progress:
    """Live counters of a run (the progress display reads them)."""

    episodes: int = 0
    rollout_tokens: int = 0
    """Completion tokens the rollouts sampled."""
    turns_judged: int = 0
    turns_trained: int = 0
    turns_dropped: int = 0
    steps: list[StepMetrics] = field(default_factory=list)
    recent_rewards: list[float] = field(default_factory=list)
    recent_judge_scores: list[float] = field(default_factory=list)
    by_env: dict[str, EnvProgress] = field(default_factory=dict)
    group_variance_share: float | None = None
    """The last step's share of baseline groups whose rewards differed
    (`trainers.diagnostics.variance_share`); None: no step, or no group of several."""

    def env(self, name: str) -> EnvProgress:
        """The counters of env `name` (made on first use)."""
        return self.by_env.setdefault(name, EnvProgress())

    def record(self, env: str, episode: EpisodeRecord) -> None:
        """Counts one finished episode of `env`."""
        self.env(env).episodes.append(episode)
        self.episodes += 1
        self.rollout_tokens += episode.completion_tokens
        self.recent_rewards.append(episode.reward)

    @property
    def mean_recent_reward(self) -> float:
        return _mean(self.recent_rewards[-32:]) or 0.0

    @property
    def mean_recent_judge_score(self) -> float | None:
        return _mean(self.recent_judge_scores[-64:])


def episode_summary(episodes: Sequence[EpisodeRecord]) -> dict[str, Any]:
    """What a set of episodes of one env came to: counts, means and the share of
    successes (means are None where there is no episode)."""
    return {
        "episodes": len(episodes),
        "reward": _mean([e.reward for e in episodes]),
        "success_rate": _mean([float(e.success) for e in episodes]),
        "turns_per_episode": _mean([float(e.turns) for e in episodes]),
        "tokens_per_episode": _mean([float(e.completion_tokens) for e in episodes]),
        "episode_wall_s": _mean([e.wall_s for e in episodes]),
        "failed": sum(e.status == "failed" for e in episodes),
        "truncated": sum(e.status == "truncated" for e in episodes),
        "interrupted": sum(e.status == "interrupted" for e in episodes),
        "replayed": sum(e.replay for e in episodes),
    }


def learning_health(progress: Progress) -> str:
    """The progress bar's view of whether the last step could learn: its share of groups
    with reward variance, the policy's entropy and its KL to where RL started (each left
    out where unknown)."""
    step = progress.steps[-1] if progress.steps else None
    parts = []
    if progress.group_variance_share is not None:
        parts.append(f"varied groups {progress.group_variance_share:.0%}")
    if step is not None and step.entropy is not None:
        parts.append(f"entropy {step.entropy:.2f}")
    if step is not None and step.kl_to_start is not None:
        parts.append(f"kl {step.kl_to_start:.4f}")
    return "".join(f" | {part}" for part in parts)


def _mean(values: Sequence[float]) -> float | None:
    return round(math.fsum(values) / len(values), 6) if values else None
