"""The embedded engine's attention leaves grouped KV heads grouped and gives transformers'
sdpa logits, padding in the middle of rows included."""

from __future__ import annotations

import torch

from agents import models
from agents.engines.attention import NAME, use_grouped_sdpa


def test_grouped_sdpa_gives_transformers_sdpa_logits():
    model, _ = models.load("tiny")
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    ids = torch.randint(
        0, model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0)
    )
    mask = torch.ones_like(ids)
    mask[0, :8] = 0  # left padding
    mask[1, 10:14] = 0  # padding between a reused prefix and the rest of a prompt
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        expected = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        use_grouped_sdpa(model)
        assert model.config._attn_implementation == NAME
        got = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    assert torch.allclose(got[real], expected[real], atol=1e-5, rtol=0)
