"""Drawing the next token from raw log-probs: temperature, top-p and a generator per row.

The embedded engine's scheduler (`agents.engines.batching`) calls `pick_tokens` once a step
for every row of its batch.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import Any

import torch

from agents.engines.base import SamplingParams


def pick_tokens(
    logprobs: torch.Tensor,
    samplings: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int | None]:
    """Each row's next token from its raw log-probs (rows, vocabulary), with its request's
    temperature, top-p and generator; None for a row whose weights are not a distribution
    (a model that produced NaN).

    Rows that share a temperature and top-p are drawn together: one softmax, one cumulative
    sum and one search for all of them, each at a uniform draw from its own generator (a
    request's seed alone decides its tokens, whatever else shares its batch). Drawing row by
    row cost 8% of a 64-row rollout's engine time, measured with py-spy.
    """
    tokens: list[int | None] = [int(t) for t in logprobs.argmax(-1).tolist()]
    groups: dict[tuple[float, float], list[int]] = collections.defaultdict(list)
    for row, sampling in enumerate(samplings):
        if sampling.temperature != 0.0:
            groups[sampling.temperature, sampling.top_p].append(row)
    for (temperature, top_p), rows in groups.items():
        if temperature < 1e-30:  # greedy or not, row by row (`sampling_weights`)
            for row in rows:
                weights = sampling_weights(logprobs[row], temperature, top_p)
                if weights is not None:
                    tokens[row] = _draw(weights[None], [generators[row]])[0]
            continue
        weights = sampling_weights(logprobs[torch.tensor(rows)], temperature, top_p)
        assert weights is not None  # only temperatures under 1e-30 can be greedy here
        for row, token in zip(rows, _draw(weights, [generators[r] for r in rows]), strict=True):
            tokens[row] = token
    return tokens


def _draw(weights: torch.Tensor, generators: Sequence[torch.Generator | None]) -> list[int | None]:
    """One token per row of `weights` (rows, vocabulary; unnormalized), by inverse transform
    at a uniform draw from each row's generator; None for a row that is not a distribution."""
    cumulative = weights.double().cumsum(-1)
    totals = cumulative[:, -1]
    draws = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    # the first token whose cumulative weight passes the draw: a zero-weight token never does
    picked = torch.searchsorted(cumulative, (draws * totals)[:, None], right=True)[:, 0]
    picked = picked.clamp_(max=weights.shape[-1] - 1).tolist()
    valid = (torch.isfinite(totals) & (totals > 0)).tolist()
    return [int(t) if ok else None for t, ok in zip(picked, valid, strict=True)]


def sampling_weights(
    logprobs: torch.Tensor, temperature: float, top_p: float
) -> torch.Tensor | None:
    """What the next token is drawn from: weights over the last dimension (unnormalized),
    valid for every legal temperature and top-p, or None for greedy.

    Greedy at temperature 0, and at a temperature so small that even the likeliest token's
    scaled log-prob leaves the float range (1e-40 scales -1 to -inf in float32; 5e-324 is 0
    there): the softmax of all -inf is NaN, and greedy is the limit anyway (that check is
    for one row: `pick_tokens` passes such temperatures row by row). Otherwise every scaled
    log-prob is at most a finite maximum, so the softmax is valid, and top-p keeps the
    likeliest token always.
    """
    if temperature == 0.0:
        return None
    scaled = logprobs / temperature
    # The likeliest log-prob is at least -log(vocabulary size), above -100: only a temperature
    # under 1e-30 can scale it out of range, and only then is a pass over the vocabulary spent.
    if temperature < 1e-30 and not math.isfinite(scaled.max().item()):
        return None
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p. No mass precedes the likeliest
        # token: a top_p that is 0 in float32 (1e-46) would drop it too, hence the floor.
        top_p = max(top_p, torch.finfo(ordered.dtype).tiny)
        drop = ordered.cumsum(-1) - ordered >= top_p
        ordered[drop] = 0.0
        probs = torch.zeros_like(probs).scatter(-1, order, ordered)
    return probs


def top_logprobs(logprobs: torch.Tensor, ks: list[int]) -> list[Any]:
    """Each row's k likeliest ids and log-probs, (ids, log-probs) likeliest first, or None
    where its request asks for none: one `topk` for the batch, none when no row asks."""
    if not (most := max(ks)):
        return [None] * len(ks)
    values, indices = logprobs.topk(most, dim=-1)
    values, indices = values.tolist(), indices.tolist()
    return [
        (tuple(indices[row][:k]), tuple(values[row][:k])) if k else None for row, k in enumerate(ks)
    ]
