"""clawgym's LoRA kernels for vLLM on a CPU (`agents/engines/vllm_plugin`), on hand-computed
values and against vLLM's own formula. They import only torch, so they run here; that vLLM
loads them is checked by the vllm-marked tests (`test_vllm.py`)."""

from __future__ import annotations

import pytest
import torch

from agents.engines.vllm_command import CPU_LORA_BANNER, lacks_cpu_lora_kernels
from agents.engines.vllm_plugin.clawgym_vllm_plugin import (
    BANNER,
    NO_ADAPTER,
    adapter_rows,
    bgmv_expand,
    bgmv_expand_slice,
    bgmv_shrink,
)

# two adapter slots of 2x2 matrices: the identity and a swap that scales
WEIGHTS = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.0, 2.0], [3.0, 0.0]]])
INPUTS = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])


def vllm_formula(inputs, weights, indices):
    """vLLM's torch kernels: a gathered copy of the weights for every token, contracted."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    return torch.einsum("bi, boi -> bo", inputs, weights[indices])


def test_each_row_goes_through_its_own_adapter():
    rows = adapter_rows(INPUTS, WEIGHTS, torch.tensor([0, 1, 0]), torch.float32)
    assert rows.tolist() == [[1.0, 2.0], [8.0, 9.0], [5.0, 6.0]]


def test_a_batch_on_one_adapter_is_one_product():
    rows = adapter_rows(INPUTS, WEIGHTS, torch.tensor([1, 1, 1]), torch.float32)
    assert rows.tolist() == [[4.0, 3.0], [8.0, 9.0], [12.0, 15.0]]


def test_rows_without_an_adapter_are_zero_not_the_last_slots():
    """vLLM's CPU formula indexes slot -1, the last one: a base-model row in the batch got
    that adapter. Here it gets none."""
    indices = torch.tensor([1, NO_ADAPTER, 0])
    rows = adapter_rows(INPUTS, WEIGHTS, indices, torch.float32)
    assert rows.tolist() == [[4.0, 3.0], [0.0, 0.0], [5.0, 6.0]]
    assert vllm_formula(INPUTS, WEIGHTS, indices)[1].tolist() == [8.0, 9.0]
    alone = adapter_rows(INPUTS, WEIGHTS, torch.full((3,), NO_ADAPTER), torch.float32)
    assert alone.tolist() == [[0.0, 0.0]] * 3


@pytest.mark.parametrize("stacked", [3, 4], ids=["slots-out-in", "slots-1-out-in"])
def test_it_matches_vllms_formula_wherever_every_row_has_an_adapter(stacked):
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(4, 16, 64, generator=generator)
    if stacked == 4:
        weights = weights.unsqueeze(1)
    inputs = torch.randn(37, 64, generator=generator)
    for indices in (torch.randint(0, 4, (37,), generator=generator), torch.full((37,), 2)):
        ours = adapter_rows(inputs, weights, indices, torch.float32)
        assert torch.allclose(ours, vllm_formula(inputs, weights, indices), atol=1e-5)


def test_the_product_is_in_the_dtype_asked_for():
    rows = adapter_rows(INPUTS.to(torch.bfloat16), WEIGHTS, torch.tensor([0, 1, 0]), torch.float32)
    assert rows.dtype == torch.float32


def test_shrink_sets_the_scaled_product_in_the_first_columns():
    out = torch.full((3, 3), 7.0)
    bgmv_shrink(INPUTS, WEIGHTS, out, torch.tensor([0, 1, NO_ADAPTER]), scaling=0.5)
    assert out.tolist() == [[0.5, 1.0, 7.0], [4.0, 4.5, 7.0], [0.0, 0.0, 7.0]]


def test_expand_adds_or_sets_and_leaves_base_rows_as_they_were():
    out = torch.ones(3, 2)
    bgmv_expand(INPUTS, WEIGHTS, out, torch.tensor([1, NO_ADAPTER, 0]), add_inputs=True)
    assert out.tolist() == [[5.0, 4.0], [1.0, 1.0], [6.0, 7.0]]
    out = torch.ones(3, 2)
    bgmv_expand(INPUTS, WEIGHTS, out, torch.tensor([1, 1, 1]), add_inputs=False)
    assert out.tolist() == [[4.0, 3.0], [8.0, 9.0], [12.0, 15.0]]


def test_expand_slice_writes_only_its_columns():
    out = torch.zeros(3, 5)
    bgmv_expand_slice(INPUTS, WEIGHTS, out, torch.tensor([0, 0, 1]), 2, 2, add_inputs=True)
    assert out.tolist() == [
        [0.0, 0.0, 1.0, 2.0, 0.0],
        [0.0, 0.0, 3.0, 4.0, 0.0],
        [0.0, 0.0, 12.0, 15.0, 0.0],
    ]


def test_the_engine_looks_for_the_line_the_plugin_logs():
    assert CPU_LORA_BANNER == BANNER
    config = "Initializing a V1 LLM engine (v0.32.0) with config: device_config=cpu, seed=0"
    assert lacks_cpu_lora_kernels(config)
    assert not lacks_cpu_lora_kernels(f"INFO [clawgym_vllm_plugin.py:142] {BANNER}\n{config}")
    assert not lacks_cpu_lora_kernels("with config: device_config=cuda, seed=0")
