"""Tinker's losses and the checks of a forward_backward's data, on tensors: the service
(`trainers.tinker.service`) runs them on its learners."""

from __future__ import annotations

from typing import Any

import torch

from trainers.tinker.errors import UserError
from trainers.tinker.wire import Datum

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
"""The loss_fn values served (the SDK's forward_backward_custom runs on the client, over
`forward` and a linearised cross_entropy, so it needs nothing more here)."""

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

_POLICY_GRADIENT_INPUTS = ("target_tokens", "logprobs", "advantages")
_LOSS_INPUTS = {"cross_entropy": ("target_tokens",)} | {
    name: _POLICY_GRADIENT_INPUTS for name in LOSSES if name != "cross_entropy"
}
_CLIPS = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0)}
"""Each clipped loss's default (clip_low_threshold, clip_high_threshold), as Tinker's."""
DRO_BETA = 0.05
"""Tinker's default weight of DRO's quadratic penalty."""


def tinker_loss(
    loss_fn: str, logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict
) -> torch.Tensor:
    """Per-token loss of one datum (summed by the caller), as Tinker defines it, with
    ratio = exp(logp - sampling logp) and A the advantage.

    cross_entropy: -weights * logp. importance_sampling: -ratio * A. ppo: the clipped
    surrogate -min(ratio * A, clip(ratio) * A). cispo: -sg(clip(ratio)) * logp * A, the
    clipped ratio a constant coefficient. dro: -(logp * A - beta / 2 * (logp - sampling
    logp)^2). The clip range is [clip_low_threshold, clip_high_threshold] (ppo 0.8-1.2,
    cispo 0-4 by default), beta 0.05 by default.
    """
    if loss_fn == "cross_entropy":
        return -inputs.get("weights", torch.ones_like(logprobs)) * logprobs
    advantages, sampled = inputs["advantages"], inputs["logprobs"]
    if loss_fn == "dro":
        beta = float(config.get("beta", DRO_BETA))
        return -(logprobs * advantages - 0.5 * beta * (logprobs - sampled) ** 2)
    ratio = torch.exp(logprobs - sampled)
    if loss_fn == "importance_sampling":
        return -ratio * advantages
    default_low, default_high = _CLIPS[loss_fn]
    clipped = ratio.clamp(
        float(config.get("clip_low_threshold", default_low)),
        float(config.get("clip_high_threshold", default_high)),
    )
    if loss_fn == "cispo":
        return -clipped.detach() * logprobs * advantages
    return -torch.minimum(ratio * advantages, clipped * advantages)


def micro_batches(rows: list[_Checked], budget: int) -> list[list[_Checked]]:
    """Consecutive groups whose padded size (rows x longest) stays within the budget."""
    batches: list[list[_Checked]] = [[]]
    for row in rows:
        longest = max(len(t) for t, _ in [*batches[-1], row])
        if batches[-1] and longest * (len(batches[-1]) + 1) > budget:
            batches.append([])
        batches[-1].append(row)
    return batches if batches[-1] else []


def vocab_size(model: Any) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


_Checked = tuple[torch.Tensor, dict[str, torch.Tensor]]
"""A datum's tokens and loss inputs, checked."""


_LOSS_CONFIG = {"ppo": ("clip_low_threshold", "clip_high_threshold"), "dro": ("beta",)}
_LOSS_CONFIG["cispo"] = _LOSS_CONFIG["ppo"]


def check_loss_config(loss_fn: str, config: dict | None) -> None:
    """Only the loss's own settings, each a number: a typo must not train on a default."""
    allowed = _LOSS_CONFIG.get(loss_fn, ())
    for name, value in (config or {}).items():
        if name not in allowed:
            raise UserError(
                f"{loss_fn} takes no loss_fn_config {name!r}"
                + (f"; it takes {list(allowed)}" if allowed else "")
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"loss_fn_config {name!r} must be a number, got {value!r}")


def check_datum(datum: Datum, index: int, loss_fn: str, vocab: int) -> _Checked:
    """The datum's tokens and loss inputs as tensors, after checking names and shapes."""
    length = len(datum.tokens)
    if length == 0:
        raise UserError(f"datum {index}: empty model_input")
    missing = [n for n in _LOSS_INPUTS[loss_fn] if n not in datum.inputs]
    if missing:
        raise UserError(f"datum {index}: {loss_fn} needs loss_fn_inputs {missing}")
    inputs = {}
    for name, array in datum.inputs.items():
        if array.shape != (length,):
            raise UserError(
                f"datum {index}: {name} has shape {list(array.shape)}, "
                f"model_input has {length} tokens"
            )
        inputs[name] = torch.from_numpy(array.copy())
    targets = inputs["target_tokens"] = inputs["target_tokens"].long()
    tokens = torch.tensor(datum.tokens)
    if int(max(tokens.max(), targets.max())) >= vocab or int(min(tokens.min(), targets.min())) < 0:
        raise UserError(f"datum {index}: token ids outside the vocabulary of {vocab}")
    return tokens, {n: t if n == "target_tokens" else t.float() for n, t in inputs.items()}
