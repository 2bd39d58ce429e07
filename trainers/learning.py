"""What every learner shares: a turn ready to train on (`TrainSample`), what one step did
(`StepMetrics`), and the learner type the loops train through (`PolicyLearner`), which the
local peft learner (`trainers.learner.Learner`) and the Tinker one
(`trainers.tinker_learner.TinkerLearner`) both satisfy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True)
class TrainSample:
    """One turn, ready to train on."""

    seq: int
    """The turn's sequence number in the store."""
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    advantages: tuple[float, ...]
    """One per completion token."""
    policy_version: int
    teacher_prompt_ids: tuple[int, ...] | None = None
    """Top-k methods: the prompt the hinted teacher scores the completion after (the turn's
    with the judge's hint); None: the sample has no top-k distillation term."""
    top_ids: tuple[tuple[int, ...], ...] = ()
    """Top-k methods: the old student's k likeliest ids at each completion position."""
    top_logprobs: tuple[tuple[float, ...], ...] = ()
    """Their log-probs under the policy that sampled the turn."""
    images: tuple[bytes, ...] = ()
    """The prompt's images in order (a vision-language policy's): the pixels it saw."""


@dataclass(frozen=True)
class StepMetrics:
    """What one optimiser step did."""

    step: int
    version: int
    turns: int
    tokens: int
    loss: float
    kl: float
    """The KL penalty to the base model (`trainer.kl_weight`; 0 without it)."""
    kl_to_start: float | None
    """KL(policy || the policy RL started from: the adapter at the switch from an SFT warm
    start, `trainer.init_adapter`, else the base model), the k3 estimate over the step's
    sampled tokens at the weights before the step: 0 at RL's first step. None: an SFT step
    (RL has not started), `trainer.kl_estimate` off, or a learner that cannot score them."""
    entropy: float | None
    """Mean entropy (nats) of the policy's full next-token distribution at the trained
    positions, at the weights before the step (an SFT step's too); None where the learner
    does not see the distribution (Tinker)."""
    clip_fraction: float
    """Share of the step's trained tokens whose ratio of the learner's probability (before
    the step) to the rollout's lies outside [1 - clip_low, 1 + clip_high]: those PPO clips
    with the rollout as its old policy (the Tinker learner's loss). This learner's own ratio,
    to the weights before the step, is 1 all through its one update, so never clips. High:
    the policy moves far between versions (steps too large) or the engine disagrees with
    the learner (`logprob_gap`). 0 for an SFT step."""
    mean_advantage: float
    logprob_gap: float
    """Mean |learner - rollout| log-prob over tokens of on-policy turns (sampled by the
    adapter being trained): the train / rollout mismatch."""
    logprob_gap_max: float
    """The largest |learner - rollout| log-prob of any one such token."""
    grad_norm: float
    seconds: float
    distill_tokens: int = 0
    """Trained positions that had a teacher's distribution as a target: the top-k term's
    (`topk_opd`, `topk_combine`: hinted turns) or experience distillation's (`oel`). 0 for
    the other methods and for a learner without the teacher pass (Tinker)."""


OBJECTIVES = ("policy", "nll")
"""What a learner's `step` can minimise (the Tinker learner: policy only)."""


class PolicyLearner(Protocol):
    """A LoRA learner as the loops see it: a step over judged turns, published adapter
    versions, and checkpoints that resume exactly."""

    step_count: int
    """Optimiser steps taken (the checkpoint's, after a resume)."""
    version: int
    """The adapter version the last step made (0: the base model)."""
    trained_seqs: tuple[int, ...]
    """The store seqs the last step trained on."""

    def step(
        self, samples: list[TrainSample], objective: str = "policy", lr: float | None = None
    ) -> StepMetrics:
        """One optimiser step over `samples` (`objective` one of `OBJECTIVES`; `lr` None:
        `trainer.lr`); returns its metrics."""
        ...

    def save_adapter(self, name: str | None = None) -> Path:
        """Writes the current adapter as run_dir/adapters/v<version> (or run_dir/<name>)."""
        ...

    def save_checkpoint(self, cursor: dict[str, Any]) -> Path:
        """The learner's state and the caller's cursor, atomically."""
        ...

    def load_checkpoint(self) -> dict[str, Any] | None:
        """Restores the newest checkpoint; returns its state (None if there is none)."""
        ...

    def start_from(self, adapter: str | Path) -> Path:
        """Starts a fresh run from a trained adapter (`trainer.init_adapter`)."""
        ...
