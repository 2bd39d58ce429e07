import pytest
import torch

from agents import models
from agents.engines.base import POLICY
from agents.engines.embedded import EmbeddedEngine
from trainers.config import TrainerConfig
from trainers.learner import (
    Learner,
    TrainSample,
    learner_device,
    learner_dtype,
    micro_batches,
    resolve_adapter,
    token_logprobs,
)

PROMPT = (1, 5, 9, 200, 31, 7)
COMPLETION = (44, 45, 46, 47, 12)


def sample(seq=1, advantage=1.0, completion=COMPLETION, prompt=PROMPT, version=0, rollout=None):
    return TrainSample(
        seq=seq,
        prompt_ids=prompt,
        completion_ids=completion,
        rollout_logprobs=rollout or tuple(-1.0 for _ in completion),
        advantages=tuple(advantage for _ in completion),
        policy_version=version,
    )


def make_learner(tmp_path, seed=0, **changes):
    torch.manual_seed(seed)
    config = TrainerConfig(lora_rank=4, lora_alpha=8, lr=5e-2, **changes)
    return Learner("tiny", config, tmp_path)


def test_chunked_logprobs_equal_full_logits():
    model, _ = models.load("tiny")
    sequences = [list(PROMPT + COMPLETION), [3, 4, 5, 6, 7, 8, 9]]
    starts = [len(PROMPT), 2]
    chunked = token_logprobs(model, sequences, starts, chunk=2)
    for sequence, start, got in zip(sequences, starts, chunked, strict=True):
        ids = torch.tensor([sequence])
        with torch.no_grad():
            full = torch.log_softmax(model(input_ids=ids).logits[0], dim=-1)
        expected = full[start - 1 : len(sequence) - 1].gather(-1, ids[0, start:, None])[:, 0]
        assert torch.allclose(got.detach(), expected, atol=1e-5)


def test_micro_batches_respect_the_padded_token_budget():
    samples = [sample(seq=i, completion=(1,) * n) for i, n in enumerate([4, 4, 20, 2])]
    batches = micro_batches(samples, token_budget=30)
    assert [[s.seq for s in b] for b in batches] == [[0, 1], [2], [3]]
    assert all(
        len(b) * max(len(s.prompt_ids) + len(s.completion_ids) for s in b) <= 30
        for b in batches[:1]
    )


def test_a_step_moves_log_probs_in_the_direction_of_the_advantage(tmp_path):
    learner = make_learner(tmp_path)
    up, down = sample(seq=1, advantage=1.0), sample(seq=2, advantage=-1.0, completion=(90, 91, 92))
    before = [t.detach() for t in learner._logprobs([up, down])]
    metrics = learner.step([up, down])
    after = [t.detach() for t in learner._logprobs([up, down])]
    assert after[0].sum() > before[0].sum() and after[1].sum() < before[1].sum()
    assert (metrics.step, metrics.version, metrics.turns, metrics.tokens) == (1, 1, 2, 8)
    assert learner.trained_seqs == (1, 2)


def test_micro_batching_does_not_change_the_gradient(tmp_path):
    batch = [
        sample(seq=i, advantage=(-1.0) ** i, completion=tuple(range(40 + i, 46 + 2 * i)))
        for i in range(4)
    ]
    one = make_learner(tmp_path / "one", micro_batch_tokens=10_000)
    many = make_learner(tmp_path / "many", micro_batch_tokens=16)
    assert len(micro_batches(batch, 16)) == 4
    one.accumulate_gradients(batch)
    many.accumulate_gradients(batch)
    pairs = zip(one.model.named_parameters(), many.model.named_parameters(), strict=True)
    grads = [(name, a.grad, b.grad) for (name, a), (_, b) in pairs if a.requires_grad]
    assert any(g.abs().sum() > 0 for _, g, _ in grads)
    for name, a, b in grads:
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7), name


def test_checkpoint_restores_weights_optimizer_and_cursor(tmp_path):
    learner = make_learner(tmp_path)
    learner.step([sample(seq=7)])
    learner.save_checkpoint({"after_seq": 7})
    learner.step([sample(seq=8)])  # not checkpointed: lost on a crash, retrained on resume
    resumed = make_learner(tmp_path, seed=1)
    state = resumed.load_checkpoint()
    assert state is not None and state["cursor"] == {"after_seq": 7}
    assert (resumed.step_count, resumed.version, resumed.trained_seqs) == (1, 1, (7,))
    reference = make_learner(tmp_path / "ref")
    reference.step([sample(seq=7)])
    for (_, a), (_, b) in zip(
        resumed.model.named_parameters(), reference.model.named_parameters(), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-6)
    assert (
        resumed.optimizer.state_dict()["state"].keys()
        == reference.optimizer.state_dict()["state"].keys()
    )


def test_published_adapter_serves_the_learners_log_probs(tmp_path):
    learner = make_learner(tmp_path)
    learner.step([sample()])
    path = learner.save_adapter()
    assert path == tmp_path / "adapters" / "v1"
    engine = EmbeddedEngine("tiny")
    engine.load_adapter(str(path), version=learner.version)
    served = engine.score(PROMPT, COMPLETION, adapter=POLICY)
    learner.model.eval()
    with torch.no_grad():
        (trained,) = learner._logprobs([sample()])
    assert served == pytest.approx(trained.tolist(), abs=1e-4)
    assert engine.score(PROMPT, COMPLETION, adapter=None) != pytest.approx(served, abs=1e-3)


def test_the_mmap_threshold_is_fixed_on_glibc():
    import platform

    from trainers.learner import set_mmap_threshold

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert set_mmap_threshold(128 * 1024)


@pytest.mark.parametrize(
    ("requested", "cuda", "device"),
    [("auto", False, "cpu"), ("auto", True, "cuda"), ("cpu", True, "cpu"), ("cuda", True, "cuda")],
)
def test_the_learner_trains_where_asked_and_on_the_gpu_by_default(requested, cuda, device):
    assert learner_device(requested, cuda) == device


def test_asking_for_a_gpu_that_is_not_there_says_the_fix():
    with pytest.raises(ValueError, match="trainer.device=cpu"):
        learner_device("cuda", False)


@pytest.mark.parametrize(
    ("requested", "device", "bf16", "dtype"),
    [
        ("auto", "cpu", True, torch.float32),  # bf16 on this CPU is 50x slower
        ("auto", "cuda", True, torch.bfloat16),
        ("auto", "cuda", False, torch.float32),
        ("float32", "cuda", True, torch.float32),
        ("bfloat16", "cpu", False, torch.bfloat16),
    ],
)
def test_the_learner_dtype_is_bf16_only_on_a_gpu_that_has_it(requested, device, bf16, dtype):
    assert learner_dtype(requested, device, bf16) == dtype


def test_the_learner_measures_its_worst_token_gap_against_the_rollout(tmp_path):
    learner = make_learner(tmp_path)
    metrics = learner.step([sample(rollout=(-1.0, -2.0, -3.0, -4.0, -5.0))])
    assert metrics.logprob_gap_max >= metrics.logprob_gap > 0


def test_the_nll_objective_raises_the_likelihood_of_the_tokens_and_reports_it(tmp_path):
    learner = make_learner(tmp_path)
    before = sum(learner.logprobs(PROMPT, COMPLETION))
    first = learner.step([sample()], objective="nll")
    assert first.loss == pytest.approx(-before / len(COMPLETION), rel=1e-4)
    assert sum(learner.logprobs(PROMPT, COMPLETION)) > before
    with pytest.raises(ValueError, match="unknown objective"):
        learner.step([sample()], objective="dpo")


def test_a_fresh_learner_starts_from_a_saved_adapter_as_version_one(tmp_path):
    trained = make_learner(tmp_path / "a")
    trained.step([sample()])
    saved = trained.save_adapter()
    fresh = make_learner(tmp_path / "b", seed=1)
    assert fresh.logprobs(PROMPT, COMPLETION) != pytest.approx(trained.logprobs(PROMPT, COMPLETION))
    published = fresh.start_from(tmp_path / "a")  # a run directory: its newest adapter
    assert (fresh.version, fresh.step_count) == (1, 0)
    assert published == tmp_path / "b" / "adapters" / "v1"
    assert fresh.logprobs(PROMPT, COMPLETION) == pytest.approx(
        trained.logprobs(PROMPT, COMPLETION), abs=1e-5
    )
    assert resolve_adapter(saved) == saved


def test_an_adapter_of_another_shape_or_none_at_all_is_refused(tmp_path):
    trained = make_learner(tmp_path / "a")
    trained.save_adapter()
    other = Learner("tiny", TrainerConfig(lora_rank=8, lora_alpha=16), tmp_path / "b")
    with pytest.raises(ValueError, match="trainer.lora_rank"):
        other.start_from(tmp_path / "a")
    with pytest.raises(ValueError, match="neither a LoRA adapter"):
        resolve_adapter(tmp_path / "nothing")
