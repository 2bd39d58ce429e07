"""The learner's side of top-k OPD (trainers/topk.py) on the real `tiny` model: the top-k the
engine stores at sampling is what the learner recomputes, the teacher's pass reads the base
model with the hint, and the term's gradient adds up over micro-batches."""

import math

import pytest
import torch

from agents import models
from agents.engines.base import SamplingParams
from trainers.config import TrainerConfig
from trainers.learner import Learner
from trainers.learning import TrainSample
from trainers.logprobs import span_logprobs_at
from trainers.topk import TeacherTopK, TopKSettings, teacher_topk, topk_loss

MESSAGES = [{"role": "user", "content": "Say something about the sea."}]
HINTED = [{"role": "user", "content": "Say something about the sea.\n\nAnswer in French."}]


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine  # the session's engine on `tiny` (tests/conftest.py)


@pytest.fixture(scope="module")
def sampled(engine):
    sampling = SamplingParams(temperature=1.0, max_tokens=16, seed=11, top_logprobs=4)
    return engine.generate(MESSAGES, sampling=sampling)


def topk_sample(completion, teacher_prompt, seq=1, advantage=0.0, k=4):
    return TrainSample(
        seq=seq,
        prompt_ids=completion.prompt_token_ids,
        completion_ids=completion.completion_token_ids,
        rollout_logprobs=completion.completion_logprobs,
        advantages=tuple(advantage for _ in completion.completion_token_ids),
        policy_version=0,
        teacher_prompt_ids=tuple(teacher_prompt),
        top_ids=tuple(ids[:k] for ids in completion.top_ids),
        top_logprobs=tuple(values[:k] for values in completion.top_logprobs),
    )


def make_learner(tmp_path, subset="student", **changes):
    torch.manual_seed(0)
    config = TrainerConfig(lora_rank=4, lora_alpha=8, **{"lr": 5e-2, **changes})
    return Learner("tiny", config, tmp_path, TopKSettings(k=4, subset=subset))


def test_the_top_k_stored_at_sampling_is_what_the_learner_recomputes(sampled, tmp_path):
    """Token-exact: the engine's top-k ids and log-probs of each position, read again by
    the learner's forward at the same ids (nothing re-tokenized), within 1e-3."""
    learner = make_learner(tmp_path)
    prompt, ids = list(sampled.prompt_token_ids), list(sampled.completion_token_ids)
    at = torch.tensor(sampled.top_ids)
    with torch.no_grad():
        (chosen,), _, (tops,) = span_logprobs_at(
            learner.model.get_base_model(),
            [prompt + ids],
            [(0, len(prompt), len(prompt) + len(ids))],
            chunk=4,
            with_entropy=False,
            extra_ids=[at],
        )
    assert tops.shape == (len(ids), 4)
    gap = (tops - torch.tensor(sampled.top_logprobs)).abs().max().item()
    assert gap < 1e-3
    assert (chosen - torch.tensor(sampled.completion_logprobs)).abs().max().item() < 1e-3


def test_the_teacher_reads_the_base_model_with_the_hint_at_the_students_ids(engine, sampled):
    model, _ = models.load("tiny")
    hinted = engine.encode(HINTED)
    sample = topk_sample(sampled, hinted)
    with torch.no_grad():
        (teacher,) = teacher_topk(model, [sample], k=4, chunk=3)
        sequence = torch.tensor([hinted + list(sampled.completion_token_ids)])
        logits = model(input_ids=sequence).logits[0, len(hinted) - 1 : -1].float()
    full = torch.log_softmax(logits, dim=-1)
    assert teacher.ids.tolist() == full.topk(4).indices.tolist()
    assert torch.allclose(teacher.logprobs, full.topk(4).values, atol=1e-5)
    expected = full.gather(-1, torch.tensor(sampled.top_ids))
    assert torch.allclose(teacher.at_student, expected, atol=1e-5)
    # the hint changes the teacher: it is not the student's own context
    assert not torch.allclose(teacher.at_student, torch.tensor(sampled.top_logprobs), atol=1e-3)
    plain = sample.__class__(**{**sample.__dict__, "teacher_prompt_ids": None})
    assert teacher_topk(model, [plain], k=4, chunk=3) == [None]


def test_the_top_k_loss_is_the_weighted_surrogate_on_hand_computed_values():
    # one position, S = two tokens: old 0.5 and 0.25, teacher 0.25 and 0.5, c = 0.5:
    # advantages -1/3 and 1/6 (trainers/distillation.py's test), the loss at ratio 1 is
    # -(sum of advantages) = 1/6, times w_opd = 2, over a step of 1 token
    sample = TrainSample(
        1, (1,), (7,), (-0.7,), (0.0,), 0, (1, 2), ((7, 8),), ((-math.log(2), -math.log(4)),)
    )
    teacher = TeacherTopK(
        at_student=torch.tensor([[-math.log(4), -math.log(2)]]),
        ids=torch.tensor([[8, 7]]),
        logprobs=torch.tensor([[-math.log(2), -math.log(4)]]),
    )
    current = torch.tensor([[-math.log(2), -math.log(4)]], requires_grad=True)
    settings = TopKSettings(k=2, clip=0.5, weight=2.0)
    loss = topk_loss([sample], [current], [teacher], settings, total_tokens=1)
    assert loss.item() == pytest.approx(2 / 6)
    loss.backward()
    assert current.grad.flatten().tolist() == pytest.approx([2 / 3, -2 / 6])
    assert topk_loss([sample], [None], [None], settings, 1) is None


@pytest.mark.parametrize("subset", ["student", "teacher", "overlap"])
def test_two_micro_batches_give_the_top_k_gradient_of_one_batch(engine, tmp_path, subset):
    hinted = engine.encode(HINTED)
    batch = []
    for seed in range(3):
        sampling = SamplingParams(
            temperature=1.0, max_tokens=6 + 2 * seed, seed=seed, top_logprobs=4
        )
        completion = engine.generate(MESSAGES, sampling=sampling)
        batch.append(topk_sample(completion, hinted, seq=seed, advantage=0.5 * (seed - 1)))
    one = make_learner(tmp_path / "one", subset, micro_batch_tokens=10_000)
    many = make_learner(tmp_path / "many", subset, micro_batch_tokens=24)
    one.accumulate_gradients(batch)
    many.accumulate_gradients(batch)
    pairs = zip(one.model.named_parameters(), many.model.named_parameters(), strict=True)
    grads = [(name, a.grad, b.grad) for (name, a), (_, b) in pairs if a.requires_grad]
    assert any(g.abs().sum() > 0 for _, g, _ in grads)
    for name, a, b in grads:
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), name


def test_a_step_of_top_k_alone_moves_the_student_toward_the_teacher(engine, sampled, tmp_path):
    """With no reward term, a step lowers the reverse KL over the set: the student's
    log-probs at S_t move toward the hinted teacher's."""
    hinted = engine.encode(HINTED)
    sample = topk_sample(sampled, hinted)
    learner = make_learner(tmp_path, lr=1e-3)
    model = learner.model.get_base_model()
    (teacher,) = teacher_topk(model, [sample], 4, 8)  # the adapter is still zero here

    def distance():
        with torch.no_grad():
            _, _, (now,) = span_logprobs_at(
                model,
                [[*sample.prompt_ids, *sample.completion_ids]],
                [(0, len(sample.prompt_ids), len(sample.prompt_ids) + len(sample.completion_ids))],
                8,
                False,
                extra_ids=[torch.tensor(sample.top_ids)],
            )
        return (now - teacher.at_student).clamp(-1, 1).abs().sum().item()

    before = distance()
    learner.step([sample])
    assert distance() < before
