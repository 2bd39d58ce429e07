"""The embedded engine's attention: transformers' "sdpa", without copying grouped KV heads.

With an attention mask (the engine's batches always pass one: their rows are padded),
transformers' sdpa function expands grouped-query KV heads to one per query head
(`repeat_kv`) before it calls torch's `scaled_dot_product_attention`: a copy of each layer's
whole KV cache, times the group size, at every decode step (3 times on SmolLM2-135M: 9
query heads share 3 KV heads). On a CPU torch's kernel takes grouped heads itself, mask and
all (`enable_gqa=True`), with the same result: 1.9 ms a layer against 8.1 ms for 16 rows
of 600 tokens, measured here. transformers keeps the copy because on CUDA a mask with
grouped heads falls back to the slow kernel, so every other case (no mask, another device,
one KV head per query head) goes to transformers' own function.

It is served through transformers' public attention interface: `AttentionInterface` and
`AttentionMaskInterface` (the mask built as for "sdpa"), under `NAME`.

Shared-prefix (cascade) attention: a decode step may pass `shared_prefix=SharedPrefix(...)`
to the model (transformers hands unknown keyword arguments down to the attention
function). Its rows' first tokens then live once, in the prefix's own KV, not in every
row's cache: each query attends to the prefix (every row's queries at once, one product
per KV head, the prefix read once) and to its row's cache, and the two softmaxes are
joined by their log-sum-exps. On SmolLM2-135M with 64 rows sharing a 270-token system
prompt that is 26 ms of attention a step against 48 (measured on the 2-core CPU machine;
1.10x the decode rate of the main job's prompts, `benchmarks/perf/decode.py`), and the rows'
caches are that much smaller. It is off by default (`engine.share_prefixes`): a main-job
evaluation ran twice as slow with it while one row that joined before the block was picked
kept every row's cache wide (mended), and the evaluation is still not faster as a whole
(docs/results.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "clawgym_grouped_sdpa"

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
"""torch's CPU flash attention, which also returns each query's log-sum-exp."""


@dataclass(frozen=True)
class SharedPrefix:
    """KV that the first tokens of a decode step's rows share, held once.

    Attributes:
        kv: (layers, 2, kv heads, tokens, head dim): the prefix's keys and values.
        lengths: (rows,): how many of its first tokens each row reads (0: none; the rest
            of a row, and all of a row that reads 0, is in the row's cache).
    """

    kv: torch.Tensor
    lengths: torch.Tensor


def grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, with grouped KV heads left grouped under a mask on a
    CPU (where transformers would copy them)."""
    shared = kwargs.pop("shared_prefix", None)
    if shared is not None:
        return _with_shared_prefix(module, query, key, value, attention_mask, scaling, shared)
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if (
        attention_mask is None
        or not grouped
        or query.device.type != "cpu"
        or kwargs.get("position_bias") is not None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # transformers' own call with a mask: not causal (the mask says it), its output transposed
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=False,
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


def _with_shared_prefix(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    shared: SharedPrefix,
) -> tuple[torch.Tensor, None]:
    """One decode step's attention (one query a row) over the shared prefix and each row's
    cache, joined: softmax over both is each part's softmax weighted by exp(its
    log-sum-exp), normalised."""
    rows, heads, width, dim = query.shape
    if width != 1:
        raise ValueError("a shared prefix serves decode steps only (one query a row)")
    kv_heads = key.shape[1]
    group = heads // kv_heads
    # a KV head's queries side by side: (rows, kv heads, group, dim), no copy
    grouped = query.reshape(rows, kv_heads, group, dim)
    own_mask = _additive(attention_mask, query.dtype)
    own, own_lse = _flash(grouped, key, value, attn_mask=own_mask, scale=scaling)
    keys, values = shared.kv[module.layer_idx]
    prefix = keys.shape[-2]
    # every row's queries against the one prefix: (1, kv heads, rows x group, dim)
    stacked = grouped.transpose(0, 1).reshape(1, kv_heads, rows * group, dim)
    lengths = shared.lengths.clamp(min=1)  # a row that reads none is masked out below
    mask = None
    if bool((lengths < prefix).any()):
        columns = torch.arange(prefix)
        allowed = (columns[None, :] < lengths[:, None]).repeat_interleave(group, dim=0)
        mask = _additive(allowed[None, None], query.dtype)
    common, common_lse = _flash(stacked, keys[None], values[None], attn_mask=mask, scale=scaling)
    common = common.view(kv_heads, rows, group, dim).transpose(0, 1)
    common_lse = common_lse.view(kv_heads, rows, group).transpose(0, 1)
    # where a row reads no prefix its weight is exp(-inf) = 0
    common_lse = common_lse.masked_fill((shared.lengths == 0)[:, None, None], float("-inf"))
    weight = torch.sigmoid(common_lse - own_lse)[..., None]  # the prefix's share of the mass
    out = own + weight * (common - own)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2).contiguous(), None


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean attention mask (True: attend) as the additive float mask the flash kernel
    takes."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))


def use_grouped_sdpa(model: Any) -> None:
    """Switches a model on transformers' sdpa attention to `grouped_sdpa`; a model on
    another attention implementation is left as it is."""
    if model.config._attn_implementation != "sdpa":
        return
    AttentionInterface.register(NAME, grouped_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
