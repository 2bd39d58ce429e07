"""Sampling for the Tinker server: token-by-token generation with a KV cache, under
temperature, top-k, top-p and stop tokens or strings, returning each token's log-prob.

A sampled token's log-prob is the model's own (temperature 1, before top-k / top-p), as
vLLM reports it, and as `compute_logprobs` and forward_backward's `logprobs` output give it:
at temperature 1 without truncation those are the sampling distribution's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from trainers.tinker.wire import Sampled


@dataclass(frozen=True)
class SamplingParams:
    """What the server honours of Tinker's SamplingParams."""

    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    """-1: no top-k."""
    top_p: float = 1.0
    seed: int | None = None
    """None: seed 0, so an unseeded request is still reproducible."""
    stop_tokens: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()


def target_logprobs(model: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[i] | tokens[: i + 1]) for each position i."""
    logits = model(input_ids=tokens[None]).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]


def batch_target_logprobs(
    model: Any, tokens: list[torch.Tensor], targets: list[torch.Tensor]
) -> list[torch.Tensor]:
    """`target_logprobs` of several sequences in one right-padded pass (causal attention
    keeps the padding out of every real position)."""
    pad = partial(torch.nn.utils.rnn.pad_sequence, batch_first=True)
    mask = pad([torch.ones_like(row) for row in tokens])
    logits = model(input_ids=pad(tokens), attention_mask=mask).logits.float()
    picked = torch.log_softmax(logits, -1).gather(-1, pad(targets)[..., None])[..., 0]
    return [picked[row, : len(t)] for row, t in enumerate(tokens)]


def generate(
    model: Any,
    prompt: list[int],
    params: SamplingParams,
    generator: torch.Generator,
    stopped: Callable[[list[int]], bool],
) -> Sampled:
    """One continuation of `prompt`; `stopped(tokens)` says whether a stop string ended it."""
    tokens: list[int] = []
    logprobs: list[float] = []
    output = model(input_ids=torch.tensor([prompt]), use_cache=True)
    for _ in range(params.max_tokens):
        logits = output.logits[0, -1].float()
        token = draw(logits, params, generator)
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        if token in params.stop_tokens or stopped(tokens):
            return Sampled(tuple(tokens), tuple(logprobs), True)
        output = model(
            input_ids=torch.tensor([[token]]),
            past_key_values=output.past_key_values,
            use_cache=True,
        )
    return Sampled(tuple(tokens), tuple(logprobs), False)


def draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """A token from the logits under temperature, top-k and top-p (greedy at temperature 0)."""
    if params.temperature <= 0:
        return int(logits.argmax())
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.numel():
        scaled[scaled < torch.topk(scaled, params.top_k).values[-1]] = -math.inf
    if params.top_p < 1.0:
        ordered, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(ordered, -1)
        # drop a token once the more likely ones already hold top_p of the mass
        scaled[order[probs.cumsum(-1) - probs > params.top_p]] = -math.inf
    return int(torch.multinomial(torch.softmax(scaled, -1), 1, generator=generator))
