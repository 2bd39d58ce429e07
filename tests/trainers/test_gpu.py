"""The GPU path (marker `gpu`; skipped where torch sees no CUDA device): the learner trains
on the GPU in bf16 with float32 adapter weights, a run on vLLM shares the GPU with it, a run
on the embedded engine trains its learner there, and the Tinker server's training clients
train there."""

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


def test_a_run_on_the_embedded_engine_trains_its_learner_on_the_gpu(tmp_path):
    """A GPU machine without vLLM: the embedded engine samples on the CPU in fp32 and the
    learner trains on the GPU in bf16. `trainer.device=cuda` never falls back to the CPU,
    so the run's two steps were the GPU's."""
    summary = train(tmp_path / "run", "method=binary", "trainer.max_steps=2", "trainer.device=cuda")
    assert (summary["engine"], summary["steps"], summary["adapter_version"]) == ("embedded", 2, 2)
    assert summary["turns_trained"] >= 4 and summary["last_loss"] is not None
    # fp32 sampler against a bf16 learner: the gap is bf16's rounding, reported, not bounded
    print(
        f"log-prob gap, CPU fp32 sampler vs GPU bf16 learner: mean {summary['logprob_gap']}, "
        f"max {summary['logprob_gap_max']}"
    )


def test_the_tinker_servers_training_clients_train_on_the_gpu(tmp_path):
    import numpy as np

    from trainers.tinker.service import TinkerService
    from trainers.tinker.wire import Datum

    engine = TinkerService("tiny", tmp_path, device="cuda")
    engine.create_model("gpu:train:0", "tiny", rank=4)
    assert engine.learner("gpu:train:0").device.type == "cuda"
    tokens = (1, 5, 9, 200, 31, 7, 44, 45)
    inputs = {
        "target_tokens": np.asarray([*tokens[1:], 46], dtype=np.int64),
        "logprobs": np.zeros(len(tokens), dtype=np.float32),
        "advantages": np.ones(len(tokens), dtype=np.float32),
    }
    data = (Datum(tokens, inputs),)
    before, _ = engine.forward_backward("gpu:train:0", "importance_sampling", {}, data, False)
    engine.optim_step("gpu:train:0", {"learning_rate": 1e-2})
    after, _ = engine.forward_backward("gpu:train:0", "importance_sampling", {}, data, True)
    assert after[0]["logprobs"].sum() > before[0]["logprobs"].sum()
