"""Advantages: pure functions from judged turns to per-token advantages.

- binary: one scalar reward per turn (judge majority, environment outcome, or both),
  minus the group mean when several rollouts of one task share a group (GRPO);
  a turn alone in its group keeps its reward (live conversations have no baseline).
- OPD: per token, the teacher's log-prob minus the rollout's (the teacher is the base
  model given the judge's hint).
- combine: w_opd * (teacher - rollout) + w_rl * reward, dispatched by `combine_advantages`' table.

Every function takes and returns tensors (or plain numbers) and nothing else.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from trainers.distillation import clip_difference


def group_baseline(
    rewards: torch.Tensor, group_ids: Sequence[Hashable], scale_by_std: bool = False
) -> torch.Tensor:
    """Reward minus its group's mean (GRPO); singletons keep their reward.

    Args:
        rewards: [n] one reward per sample.
        group_ids: n group keys; samples of one task in one batch share a key.
        scale_by_std: also divide by the group's std (GRPO's original; off by default
            because it over-weights near-uniform groups, Dr. GRPO).
    """
    advantages = rewards.clone().float()
    for group in set(group_ids):
        members = torch.tensor([i for i, g in enumerate(group_ids) if g == group])
        if len(members) < 2:
            continue
        # float64: the mean of n equal float32 rewards is then exactly that reward, so a
        # uniform group centres to exactly 0 (in float32, 8 rewards of 0.3 left 3e-8)
        values = rewards[members].double()
        centred = values - values.mean()
        if scale_by_std:
            centred = centred / (values.std(unbiased=False) + 1e-6)
        advantages[members] = centred.float()
    return advantages


def mix_rewards(
    judge_score: float | None, env_reward: float | None, w_judge: float = 1.0, w_env: float = 1.0
) -> float | None:
    """One scalar reward from the judge's score and the environment's, whichever exist.

    A judge score of 0 (a tie, or no valid vote) is no signal; an environment reward is
    signal even when 0, since a group baseline turns it into a negative advantage. None
    when there is no signal at all: the turn is masked out of the loss.
    """
    parts = []
    if judge_score:
        parts.append(w_judge * judge_score)
    if env_reward is not None:
        parts.append(w_env * env_reward)
    return float(sum(parts)) if parts else None


def opd_advantages(
    teacher_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, clip: float | None = None
) -> torch.Tensor:
    """Per-token OPD advantage: how much likelier the hinted teacher finds each token,
    clamped to [-clip, clip] (None: unclipped; `method.diff_clip`)."""
    return clip_difference(teacher_logprobs, rollout_logprobs, clip)


def combine_advantages(
    rollout_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor | None,
    score: float,
    w_opd: float = 1.0,
    w_rl: float = 1.0,
    clip: float | None = None,
) -> torch.Tensor | None:
    """The combine method's advantage for one turn; None means the turn is dropped.

    | hint accepted (teacher given) | score   | advantage                          |
    | yes                           | +1 / -1 | w_opd * (teacher - rollout) + w_rl * score |
    | yes                           | 0       | w_opd * (teacher - rollout)        |
    | no                            | +1 / -1 | w_rl * score on every token        |
    | no                            | 0       | dropped                            |

    The teacher - rollout difference is clamped to [-clip, clip] (None: unclipped).
    """
    if teacher_logprobs is None:
        if score == 0:
            return None
        return torch.full_like(rollout_logprobs, w_rl * score)
    return w_opd * opd_advantages(teacher_logprobs, rollout_logprobs, clip) + w_rl * score


def truncated_importance_weights(
    proximal_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float = 2.0
) -> torch.Tensor:
    """Per-token weights min(pi_prox / pi_rollout, cap) for turns sampled by an older adapter.

    The PPO ratio is taken against the proximal policy (the learner's weights before this
    step); this weight corrects for the rollout's adapter being older (decoupled PPO). Equal
    log-probs give 1, so on-policy turns are unchanged. No gradient flows through it.
    """
    return torch.exp(proximal_logprobs - rollout_logprobs).clamp(max=cap).detach()


def is_stale(policy_version: int, current_version: int, max_staleness: int) -> bool:
    """Whether a turn's adapter is more than `max_staleness` versions behind."""
    return current_version - policy_version > max_staleness
