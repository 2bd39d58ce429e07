"""Sampling a prompt with images on the embedded engine: one sequence at a time, on the
scheduler thread.

A vision-language prompt does not fit the continuous batch (`agents.engines.batching`): its
image tokens' keys and values depend on pixels, not on token ids, so the prefix cache (keyed
by ids) must never hold them, and its M-RoPE positions (time, height, width per token) are
not the batch's one position per column. So such a request runs alone, as a job between two
steps of the batch: a prefill with the pixels, then a decode loop feeding each sampled token
at the next position (the prompt's last position plus one, in all three M-RoPE sections,
as the model's own `generate` does). The positions and the pixel inputs come from
`agents.vision.forward_inputs`, the function the learner computes its log-probs with, so
the log-probs recomputed there match these (tested to 1e-6 in fp32 on `tiny-vl`). Text-only
requests on a VL model keep the batch (their positions are the text positions).
"""

from __future__ import annotations

from typing import Any

import torch

from agents.engines.batch import Request
from agents.engines.sampling import pick_tokens, top_logprobs
from agents.vision import PixelInputs, forward_inputs, masked_logits


def decode_alone(
    model: Any,
    extra: dict[str, Any],
    request: Request,
    pixels: PixelInputs,
    eos_ids: set[int],
    banned: torch.Tensor | None,
) -> None:
    """Samples `request` to its end, handing each token to its events (`Request.record`);
    `model` and `extra` are the adapter table's for its adapter; `banned` ids are never
    sampled (`agents.vision.markup_ids`)."""
    ids = torch.tensor([request.prompt_ids])
    mask = torch.ones_like(ids)
    inputs = forward_inputs(model, ids, mask, pixels)
    position = inputs["position_ids"][:, :, -1:]
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **inputs, **extra)
    while not request.cancelled:
        logprobs = torch.log_softmax(masked_logits(out.logits[:, -1].float(), banned), dim=-1)
        token = pick_tokens(logprobs, [request.sampling], [request.generator])[0]
        if token is None:
            raise ValueError("the model's next-token distribution is not finite")
        top = top_logprobs(logprobs, [request.sampling.top_logprobs])[0]
        if request.record(token, float(logprobs[0, token]), top, eos_ids):
            return
        position = position + 1
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = model(
            input_ids=torch.tensor([[token]]),
            attention_mask=mask,
            position_ids=position,
            past_key_values=out.past_key_values,
            use_cache=True,
            **extra,
        )
