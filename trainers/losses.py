"""Losses: pure functions of per-token tensors, shaped [batch, tokens] with a 0/1 mask.

Every loss is a sum over tokens divided by `total_tokens`, the number of trained tokens in
the whole optimiser step, not in the micro-batch: so the gradients of micro-batches add
up to exactly the gradient of the full batch (the normalisation bug TRL and open-instruct
both shipped came from dividing by each micro-batch's own count).
"""

from __future__ import annotations

import torch


def clipped_policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    total_tokens: int,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    importance_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """PPO's clipped surrogate, token-level, with a separate upper clip (DAPO's clip-higher).

    Args:
        logprobs: log-probs of the sampled tokens under the weights being trained.
        proximal_logprobs: the same under the weights at the start of this step (no grad).
        advantages: per-token advantages.
        mask: 1 for trained tokens, 0 for padding and masked turns.
        total_tokens: trained tokens in the whole step (across micro-batches).
        clip_low, clip_high: the ratio is kept in [1 - clip_low, 1 + clip_high].
        importance_weights: truncated weights for turns from an older adapter.
    """
    ratio = torch.exp(logprobs - proximal_logprobs.detach())
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    if importance_weights is not None:
        per_token = per_token * importance_weights
    return (per_token * mask).sum() / max(total_tokens, 1)


def nll_loss(logprobs: torch.Tensor, mask: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Supervised fine-tuning's loss: the mean negative log-likelihood of the trained tokens
    of the whole step (summed here, divided by the step's token count)."""
    return -(logprobs * mask).sum() / max(total_tokens, 1)


def kl_to_base(
    logprobs: torch.Tensor, base_logprobs: torch.Tensor, mask: torch.Tensor, total_tokens: int
) -> torch.Tensor:
    """KL(policy || base), the penalty of `trainer.kl_weight`: `k3_kl` against the base
    model's log-probs."""
    return k3_kl(logprobs, base_logprobs, mask, total_tokens)


def k3_kl(
    logprobs: torch.Tensor, reference_logprobs: torch.Tensor, mask: torch.Tensor, total_tokens: int
) -> torch.Tensor:
    """KL(policy || reference) from the sampled tokens alone, with the k3 estimator
    exp(d) - d - 1, d = reference - policy, per token: non-negative, unbiased, low variance
    (Schulman's approximation). No gradient flows into the reference."""
    delta = reference_logprobs.detach() - logprobs
    return ((torch.exp(delta) - delta - 1.0) * mask).sum() / max(total_tokens, 1)


def k3_kl_of_scored(
    logprobs: torch.Tensor, scored: list[torch.Tensor | None], mask: torch.Tensor, total: int
) -> float:
    """`k3_kl` over the rows that have reference log-probs (`scored`, None for the rows an
    estimate does not read), padded to the widest of those."""
    rows = [index for index, row in enumerate(scored) if row is not None]
    if not rows:
        return 0.0
    present = [row for row in scored if row is not None]
    reference = torch.nn.utils.rnn.pad_sequence(present, batch_first=True).to(logprobs.device)
    width = reference.shape[1]
    return k3_kl(logprobs[rows, :width], reference, mask[rows, :width], total).item()


def spread_positions(count: int, wanted: int) -> list[int]:
    """`wanted` of the positions 0..count-1, evenly spread from the first (all of them when
    `wanted` is 0 or not below `count`): which of a step's turns an estimate reads."""
    if wanted <= 0 or wanted >= count:
        return list(range(count))
    return [index * count // wanted for index in range(wanted)]


def entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """The entropy -sum p log p of each distribution over the last dimension (the
    vocabulary), from its log-probs; a distribution that has stopped exploring has ~0."""
    return -(logprobs.exp() * logprobs).sum(-1)


def clip_fraction(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> float:
    """Share of trained tokens whose ratio left the clip range (a health metric)."""
    ratio = torch.exp(logprobs.detach() - proximal_logprobs)
    outside = ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).float()
    return float((outside * mask).sum() / mask.sum().clamp(min=1))
