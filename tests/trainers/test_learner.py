import os
import threading
import time
import types
from collections.abc import Callable

import pytest
import torch

from agents import models
from agents.engines.base import POLICY
from agents.engines.embedded import EmbeddedEngine
from trainers.checkpoints import resolve_adapter
from trainers.config import TrainerConfig, checkpointing_mode
from trainers.learner import Learner
from trainers.learning import TrainSample
from trainers.logprobs import (
    micro_batches,
    packed_turns,
    padded_tokens,
    shared_prefix_length,
    token_logprobs,
)
from trainers.lora import activation_bytes, learner_device, learner_dtype, release_openmp_workers

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


def assert_same_gradients(one, two, batch, atol=1e-6):
    """Both learners accumulate `batch`; their LoRA gradients agree (and are not all 0)."""
    one.accumulate_gradients(batch)
    two.accumulate_gradients(batch)
    pairs = zip(one.model.named_parameters(), two.model.named_parameters(), strict=True)
    grads = [(name, a.grad, b.grad) for (name, a), (_, b) in pairs if a.requires_grad]
    assert any(g.abs().sum() > 0 for _, g, _ in grads)
    for name, a, b in grads:
        assert torch.allclose(a, b, rtol=1e-4, atol=atol), name


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


def test_shared_prefix_length_leaves_every_row_a_token_and_skips_short_prefixes():
    head = list(range(100, 140))
    assert shared_prefix_length([head + [1, 2], head + [1, 3], head + [4]]) == 40
    assert shared_prefix_length([head, head + [5]]) == 39  # the shortest keeps its last
    assert shared_prefix_length([head[:31] + [1, 2], head[:31] + [1, 3]]) == 32
    assert shared_prefix_length([head[:30] + [1], head[:30] + [2]]) == 0
    rows = [sample(prompt=tuple(head), completion=(n,) * n) for n in (2, 6)]
    assert padded_tokens(rows) == 2 * 46
    assert padded_tokens(rows, share_prefix=True) == 40 + 2 * 6


def test_a_shared_prefix_gives_the_log_probs_and_gradients_of_full_rows(tmp_path):
    """Rows that start with the same 40 tokens (an agent's system prompt), of different
    lengths and starts: one prefix pass gives what a pass per row gives."""
    head = tuple(range(300, 340))
    batch = [
        sample(seq=1, prompt=head + (7, 8), completion=(44, 45, 46), advantage=1.0),
        sample(seq=2, prompt=head + (9,), completion=(50, 51, 52, 53, 54, 55), advantage=-1.0),
        sample(seq=3, prompt=head[:-1], completion=(head[-1], 60, 61), advantage=0.5),
    ]
    full = make_learner(tmp_path / "full", share_prefix=False, gradient_checkpointing=False)
    shared = make_learner(tmp_path / "shared", share_prefix=True, gradient_checkpointing=False)
    assert shared._share_prefix
    for a, b in zip(full._logprobs(batch), shared._logprobs(batch), strict=True):
        assert torch.allclose(a.detach(), b.detach(), atol=1e-5)
    assert_same_gradients(full, shared, batch)


def two_turn_episode(head=()):
    """Turn 2's prompt is turn 1's prompt, completion and a tool reply, token for token."""
    first = sample(seq=1, prompt=head + PROMPT, completion=(44, 45, 46), advantage=1.0)
    second_prompt = first.prompt_ids + first.completion_ids + (70, 71, 72)
    second = sample(seq=2, prompt=second_prompt, completion=(80, 81), advantage=-0.5)
    return first, second


def test_an_episodes_turns_pack_into_its_last_turns_row():
    first, second = two_turn_episode()
    other = sample(seq=3, prompt=(9, 9) + PROMPT, completion=(44,))
    inside = sample(seq=4, prompt=PROMPT, completion=(44, 45))  # begins turn 1 too
    assert packed_turns([first, other, second]) == [[2, 0], [1]]
    assert packed_turns([inside, first, second]) == [[2, 1, 0]]
    diverging = sample(seq=5, prompt=PROMPT, completion=(44, 99))
    assert packed_turns([first, diverging]) == [[0], [1]]


@pytest.mark.parametrize("share_prefix", [False, True])
def test_packed_turns_give_the_log_probs_and_gradients_of_a_row_each(tmp_path, share_prefix):
    head = tuple(range(300, 340)) if share_prefix else ()
    first, second = two_turn_episode(head)
    batch = [first, sample(seq=3, prompt=head + (5, 6), completion=(50, 51), advantage=0.5), second]
    rows = make_learner(tmp_path / "rows", pack_turns=False, gradient_checkpointing=False)
    packed = make_learner(
        tmp_path / "packed", share_prefix=share_prefix, gradient_checkpointing=False
    )
    assert [len(b) for b in packed._micro_batches(batch)] == [3]
    for a, b in zip(rows._logprobs(batch), packed._logprobs(batch), strict=True):
        assert a.shape == b.shape
        assert torch.allclose(a.detach(), b.detach(), atol=1e-5)
    assert_same_gradients(rows, packed, batch)


def test_scoring_one_turn_after_another_reuses_their_prefix_exactly(tmp_path):
    """`Learner.logprobs` keeps the prefix two calls share: later calls that begin with it
    give what a cold pass gives, and a step (new weights) drops it."""
    learner = make_learner(tmp_path, gradient_checkpointing=False)
    head = tuple(range(300, 340))
    first, second = two_turn_episode(head)
    other = sample(seq=3, prompt=head + (5, 6), completion=(50, 51))
    cold = [t.detach().tolist() for t in learner._logprobs([first, second, other])]
    turns = (first, second, other, second)  # the last begins with the prefix kept before it
    scored = [learner.logprobs(s.prompt_ids, s.completion_ids) for s in turns]
    assert learner._scorer._held is not None and len(learner._scorer._held[1]) == 40
    for got, expected in zip(scored, [*cold, cold[1]], strict=True):
        assert got == pytest.approx(expected, abs=1e-5)
    learner.step([first])
    assert learner._scorer._held is None
    moved = learner._logprobs([second])[0].detach().tolist()
    assert learner.logprobs(second.prompt_ids, second.completion_ids) == pytest.approx(
        moved, abs=1e-5
    )


def test_gradient_checkpointing_trains_without_the_shared_prefix(tmp_path):
    learner = make_learner(tmp_path, share_prefix=True, gradient_checkpointing=True)
    assert not learner._share_prefix


def test_gradient_checkpointing_reads_auto_true_and_false_and_refuses_the_rest():
    assert [checkpointing_mode(v) for v in ("auto", True, "False", "on", False)] == [
        "auto",
        "on",
        "off",
        "on",
        "off",
    ]
    with pytest.raises(ValueError, match="use auto, true or false"):
        checkpointing_mode("sometimes")


def test_activation_bytes_counts_hidden_and_intermediate_tensors_per_layer_and_position():
    shape = types.SimpleNamespace(hidden_size=4, intermediate_size=8, num_hidden_layers=2)
    # per layer and position 12 x 4 + 5 x 8 = 88 values of 4 bytes, doubled, x 10 x 2 layers
    assert activation_bytes(10, shape, 4) == 2 * 10 * 2 * 88 * 4 == 14080


@pytest.mark.parametrize("budget_gib, checkpointed", [(1e-9, True), (64.0, False)])
def test_auto_checkpointing_turns_on_only_for_a_pass_past_the_memory_budget(
    tmp_path, budget_gib, checkpointed
):
    first, second = two_turn_episode(tuple(range(300, 340)))
    batch = [first, second]
    learner = make_learner(
        tmp_path / "auto", gradient_checkpointing="auto", memory_budget_gib=budget_gib
    )
    plain = make_learner(tmp_path / "plain", gradient_checkpointing=False)
    assert_same_gradients(learner, plain, batch)
    assert learner._checkpointed is checkpointed
    assert learner._share_prefix is not checkpointed


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
    assert_same_gradients(one, many, batch, atol=1e-7)


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

    from trainers.lora import set_mmap_threshold

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


def _os_threads() -> int:
    """This process's threads, OpenMP's workers included (threading sees Python's only)."""
    return len(os.listdir("/proc/self/task"))


def _settled_thread_count(at_most: int) -> int:
    """This process's thread count once it is at most `at_most`, or after 10 s: OpenMP's
    workers end a moment after they are told to."""
    deadline = time.monotonic() + 10
    while _os_threads() > at_most and time.monotonic() < deadline:
        time.sleep(0.05)
    return _os_threads()


def openmp_thread_counts(calls: dict[str, Callable[[], object]]) -> dict[str, int]:
    """Runs each call on a fresh thread (2 torch threads, no OpenMP team of its own yet, as
    a server's or a pipeline's long-lived threads start), after a matrix product that starts
    a team there; returns the process's thread count before and after each call. Skips
    where the premise does not hold (no OpenMP workers started, torch not on libgomp)."""
    big = torch.randn(768, 768)
    counts: dict[str, int] = {}

    def caller() -> None:
        torch.set_num_threads(2)
        counts["before"] = _os_threads()
        for _ in range(4):
            big @ big
        counts["after a product"] = _os_threads()
        for name, call in calls.items():
            call()
            counts[name] = _settled_thread_count(counts["before"])

    threads = torch.get_num_threads()
    try:
        worker = threading.Thread(target=caller)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(threads)
    if counts["after a product"] == counts["before"]:
        pytest.skip("torch's matrix product started no OpenMP workers on this machine")
    if not release_openmp_workers():
        pytest.skip("torch does not run on GNU libgomp here")
    return counts


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_learner_step_leaves_no_openmp_workers_behind(tmp_path):
    learner = make_learner(tmp_path)
    counts = openmp_thread_counts(
        {
            # tiny's own ops may be too small to go parallel: the product started the team
            "after a step": lambda: learner.step([sample()]),
            "after scoring": lambda: learner.logprobs(PROMPT, COMPLETION),
        }
    )
    assert counts["after a step"] == counts["after scoring"] == counts["before"]
