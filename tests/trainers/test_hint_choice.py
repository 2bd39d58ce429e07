"""Hint candidates and the choice among them (trainers/hint_choice.py, the judge's
`hinted_judgement`): hand-computed overlaps, the selection each `hint_selection` makes, and
the learner's choice on the real `tiny` model against the engine's own teacher scores."""

import pytest
import torch

from agents.engines.base import SamplingParams
from agents.trajectory import Judgement
from tests.agents.test_trajectory import make_turn
from trainers.config import TrainerConfig
from trainers.hint_choice import (
    HintChooser,
    Scored,
    chosen_judgement,
    longest_hint,
    overlaps,
    score_contexts,
)
from trainers.judge import hinted_judgement, with_hint
from trainers.learner import Learner

CANDIDATES = ("Answer in French, please.", "Use bullet points for everything.", "Be brief now.")


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine  # the session's engine on `tiny` (tests/conftest.py)


@pytest.fixture(scope="module")
def sampled_turn(engine):
    messages = ({"role": "user", "content": "Tell me about the sea."},)
    completion = engine.generate(messages, sampling=SamplingParams(max_tokens=12, seed=3))
    return make_turn(
        prompt_messages=messages,
        prompt_token_ids=completion.prompt_token_ids,
        completion_token_ids=completion.completion_token_ids,
        completion_logprobs=completion.completion_logprobs,
        completion=completion.message,
        judgement=Judgement((1, 1, 1), 1.0, hint_candidates=CANDIDATES),
    )


def test_overlaps_count_shared_ids_over_every_token():
    student = torch.tensor([[1, 2], [3, 4]])
    first = torch.tensor([[2, 9], [8, 7]])  # 1 + 0
    second = torch.tensor([[2, 1], [4, 3]])  # 2 + 2
    assert overlaps(student, [first, second]) == [1, 4]


def test_the_largest_overlap_wins_keeping_its_teacher_and_every_score():
    judgement = Judgement((1, 1, 1), 1.0, hint_candidates=CANDIDATES)
    teachers = [Scored(torch.zeros(2, 1), torch.tensor([-float(i), -0.5])) for i in range(3)]
    chosen = chosen_judgement(judgement, [3, 5, 5], teachers)  # the first of equals
    assert chosen.hint == CANDIDATES[1] and chosen.hint_overlaps == (3, 5, 5)
    assert chosen.teacher_logprobs == (-1.0, -0.5)
    assert chosen.hint_candidates == CANDIDATES and not chosen.awaits_hint_choice


@pytest.mark.parametrize(
    ("selection", "hint", "pending"),
    [
        ("overlap", None, True),
        ("longest", CANDIDATES[1], False),
        ("shortest", CANDIDATES[2], False),
    ],
)
def test_the_judge_chooses_by_length_now_and_leaves_overlap_to_the_learner(
    engine, sampled_turn, selection, hint, pending
):
    judgement = hinted_judgement((1,), 1.0, CANDIDATES, selection, engine, sampled_turn)
    assert judgement.hint_candidates == CANDIDATES and judgement.hint == hint
    assert judgement.awaits_hint_choice is pending
    assert (judgement.teacher_logprobs is None) is pending
    # a single candidate needs no choice, whatever the selection
    one = hinted_judgement((1,), 1.0, CANDIDATES[:1], selection, engine, sampled_turn)
    assert one.hint == CANDIDATES[0] and one.teacher_logprobs is not None
    none = hinted_judgement((-1,), -1.0, (), selection, engine, sampled_turn)
    assert none == Judgement((-1,), -1.0)


def test_the_learner_chooses_the_candidate_of_largest_overlap_on_the_tiny_model(
    engine, sampled_turn, tmp_path
):
    learner = Learner("tiny", TrainerConfig(lora_rank=4, lora_alpha=8), tmp_path)
    chooser = HintChooser(learner.model, engine.encode, k=4, chunk=5)
    chosen = chooser.choose(sampled_turn)
    # the overlaps again, one candidate at a time, against the engine's sampled top-k
    base = learner.model.get_base_model()
    with torch.no_grad(), learner.model.disable_adapter():
        prompts = [engine.encode(with_hint(sampled_turn.prompt_messages, h)) for h in CANDIDATES]
        alone = [
            score_contexts(base, [p], sampled_turn.completion_token_ids, 4, 64)[0] for p in prompts
        ]
    with torch.no_grad():
        student = score_contexts(
            base, [sampled_turn.prompt_token_ids], sampled_turn.completion_token_ids, 4, 64
        )[0].top_ids
    expected = overlaps(student, [s.top_ids for s in alone])
    assert chosen.hint_overlaps == tuple(expected)
    assert chosen.hint == CANDIDATES[expected.index(max(expected))]
    assert all(0 <= o <= 4 * len(sampled_turn.completion_token_ids) for o in expected)
    # the chosen hint's teacher log-probs are the engine's teacher's (same base weights)
    hinted = engine.encode(with_hint(sampled_turn.prompt_messages, chosen.hint))
    reference = engine.score(hinted, sampled_turn.completion_token_ids, adapter=None)
    assert chosen.teacher_logprobs == pytest.approx(reference, abs=1e-4)
    # padding a candidate's row to the longest prompt changes nothing
    index = CANDIDATES.index(chosen.hint)
    assert chosen.teacher_logprobs == pytest.approx(alone[index].sampled.tolist(), abs=1e-5)


def test_stored_top_k_is_the_student_and_a_turn_without_choice_is_refused(
    engine, sampled_turn, tmp_path
):
    learner = Learner("tiny", TrainerConfig(lora_rank=4, lora_alpha=8), tmp_path)
    chooser = HintChooser(learner.model, engine.encode, k=2, chunk=64)
    n = len(sampled_turn.completion_token_ids)
    # a stored top-k (k = 3, read as its first 2) stands for the student: no forward
    stored = sampled_turn.replace(
        completion_top_ids=tuple((0, 1, 2) for _ in range(n)),
        completion_top_logprobs=tuple((-1.0, -2.0, -3.0) for _ in range(n)),
    )
    with torch.no_grad(), learner.model.disable_adapter():
        base = learner.model.get_base_model()
        prompts = [engine.encode(with_hint(stored.prompt_messages, h)) for h in CANDIDATES]
        teachers = score_contexts(base, prompts, stored.completion_token_ids, 2, 64)
    student = torch.tensor([(0, 1) for _ in range(n)])
    expected = overlaps(student, [t.top_ids for t in teachers])
    assert chooser.choose(stored).hint_overlaps == tuple(expected)
    with pytest.raises(ValueError, match="no hint choice to make"):
        chooser.choose(sampled_turn.replace(judgement=Judgement((1,), 1.0, "Be brief now.")))


def test_without_full_logits_the_longest_wins_with_the_engines_teacher(engine, sampled_turn):
    chosen = longest_hint(engine, sampled_turn)
    assert chosen.hint == CANDIDATES[1] and chosen.hint_overlaps == ()
    hinted = engine.encode(with_hint(sampled_turn.prompt_messages, CANDIDATES[1]))
    expected = engine.score(hinted, sampled_turn.completion_token_ids, adapter=None)
    assert chosen.teacher_logprobs == pytest.approx(expected)
