"""The GPU path (marker `gpu`; skipped where torch sees no CUDA device): the learner trains
on the GPU in bf16 with float32 adapter weights, and a run on vLLM shares the GPU with it."""

import pytest
import torch

from tests.trainers.test_learner import make_learner, sample
from tests.trainers.test_run import train

pytestmark = pytest.mark.gpu


def test_the_learner_trains_on_the_gpu_in_bf16_with_float32_adapters(tmp_path):
    learner = make_learner(tmp_path)
    assert learner.device.type == "cuda"
    base = [p for n, p in learner.model.named_parameters() if "lora_" not in n]
    adapters = [p for n, p in learner.model.named_parameters() if "lora_" in n]
    expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    assert {p.dtype for p in base} == {expected} and {p.dtype for p in adapters} == {torch.float32}
    before = [p.detach().clone() for p in adapters]
    metrics = learner.step([sample(advantage=1.0), sample(seq=2, advantage=-1.0)])
    assert torch.isfinite(torch.tensor(metrics.loss)) and metrics.grad_norm > 0
    assert any(not torch.equal(a, b) for a, b in zip(adapters, before, strict=True))
    assert (learner.save_adapter() / "adapter_model.safetensors").exists()


@pytest.mark.vllm
def test_a_run_on_vllm_shares_the_gpu_with_the_learner(tmp_path):
    summary = train(
        tmp_path / "run",
        "engine=vllm",
        "engine.max_lora_rank=8",
        "method=binary",
        "trainer.max_steps=2",
    )
    assert (summary["engine"], summary["steps"], summary["adapter_version"]) == ("vllm", 2, 2)
    print(
        f"log-prob gap on the GPU: mean {summary['logprob_gap']}, max {summary['logprob_gap_max']}"
    )
