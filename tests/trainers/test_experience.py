"""Experience distillation (`method=oel`): the notes' prompt and the teacher's context on
hand-written values, the writer on a real store and the tiny model's engine, the judging
loop waiting for a session's end, the samples, and the learner's tail-bin KL term."""

import math
import threading

import pytest
import torch

from agents.engines.base import SamplingParams
from agents.store import Store
from agents.trajectory import Session, SessionStatus, TurnStatus, TurnType
from tests.agents.test_trajectory import make_turn
from trainers.config import MethodConfig, TrainerConfig
from trainers.experience import (
    COVERS_KEY,
    EXPERIENCE_HEADER,
    NOTES_KEY,
    ExperienceWriter,
    has_ended,
    transcript,
    with_experience,
)
from trainers.judge import FeedbackJudge
from trainers.judge_config import JudgeConfig
from trainers.judging import JudgeLoop
from trainers.learner import Learner
from trainers.learning import TrainSample
from trainers.logprobs import span_logprobs_at
from trainers.progress import Progress
from trainers.samples import oel_sample, select
from trainers.topk import TeacherTopK, TopKSettings, teacher_topk, topk_loss

NOTES = "- This user wants answers under ten words."
QUESTION = {"role": "user", "content": "What is the capital of France?"}


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine  # the session's engine on `tiny` (tests/conftest.py)


def test_the_notes_go_into_the_system_prompt_or_make_one():
    system = {"role": "system", "content": "You are helpful."}
    assert with_experience([system, QUESTION], NOTES) == [
        {"role": "system", "content": "You are helpful.\n\n" + EXPERIENCE_HEADER + NOTES},
        QUESTION,
    ]
    assert with_experience([QUESTION], NOTES) == [
        {"role": "system", "content": EXPERIENCE_HEADER + NOTES},
        QUESTION,
    ]


def test_the_transcript_is_the_last_turns_history_reply_and_what_followed():
    first = make_turn(prompt_messages=(QUESTION,), completion={"role": "assistant", "content": "A"})
    last = make_turn(
        index=1,
        prompt_messages=(
            QUESTION,
            {"role": "assistant", "content": "Paris, a city of light and history."},
            {"role": "user", "content": "Shorter."},
        ),
        completion={"role": "assistant", "content": "Paris."},
        next_state=({"role": "user", "content": "Thanks!"},),
    )
    assert transcript([first, last]) == (
        "user: What is the capital of France?\n"
        "assistant: Paris, a city of light and history.\n"
        "user: Shorter.\n"
        "assistant: Paris.\n"
        "user: Thanks!"
    )
    assert transcript([]) == ""


def test_a_session_ends_when_closed_or_when_every_turn_has_its_next_state():
    waiting, answered = make_turn(), make_turn(next_state=())
    assert not has_ended(Session("s", "e"), [answered, waiting])
    assert has_ended(Session("s", "e"), [answered])
    assert has_ended(Session("s", "e", status=SessionStatus.DONE), [waiting])
    assert not has_ended(Session("s", "e"), [])


def conversation(engine, store, session_id="s", turns=1, status=SessionStatus.OPEN):
    """A live-like session of `turns` sampled replies, the last still unanswered."""
    store.add_session(Session(session_id, "live", status=status))
    for index in range(turns):
        completion = engine.generate([QUESTION], sampling=SamplingParams(max_tokens=6, seed=index))
        store.add_turn(
            make_turn(
                session_id=session_id,
                index=index,
                prompt_messages=(QUESTION,),
                prompt_token_ids=completion.prompt_token_ids,
                completion_token_ids=completion.completion_token_ids,
                completion_logprobs=completion.completion_logprobs,
                completion=completion.message,
            )
        )


def test_the_writer_waits_for_the_end_writes_once_and_again_when_the_user_comes_back(
    engine, tmp_path
):
    with Store(tmp_path / "store.sqlite") as store:
        conversation(engine, store, turns=1)
        writer = ExperienceWriter(engine, store, "experience", max_tokens=8, temperature=1.0)
        assert writer.notes("s") is None  # the user may still answer
        store.set_next_state("s", 0, ({"role": "user", "content": "Too long."},))
        notes = writer.notes("s")
        metadata = store.session("s").metadata
        assert notes is not None and metadata == {NOTES_KEY: notes, COVERS_KEY: 1}
        store.update_session_metadata("s", {NOTES_KEY: "kept"})
        assert writer.notes("s") == "kept"  # the same turns: not written again
        store.add_turn(make_turn(index=1, next_state=()))  # the user came back
        assert writer.notes("s") != "kept"
        assert store.session("s").metadata[COVERS_KEY] == 2


def test_the_judging_loop_judges_a_sessions_turns_once_its_notes_are_written(engine, tmp_path):
    with Store(tmp_path / "store.sqlite") as store:
        conversation(engine, store, "open", turns=1)
        conversation(engine, store, "done", turns=1)
        for session_id in ("open", "done"):
            store.set_next_state(session_id, 0, ({"role": "user", "content": "Thanks!"},))
        store.add_turn(make_turn(session_id="open", index=1))  # awaits the user
        store.finish_session("done")
        writer = ExperienceWriter(engine, store, "experience", max_tokens=8, temperature=1.0)
        judge = FeedbackJudge(JudgeConfig(kind="feedback"), engine)
        loop = JudgeLoop(store, judge, {}, False, Progress(), experience=writer)
        assert loop.judge_pending(threading.Event())
        judged = store.turns(status=TurnStatus.JUDGED, turn_type=TurnType.MAIN)
        assert [(t.session_id, t.judgement.score) for _, t in judged] == [("done", 1.0)]
        assert NOTES_KEY in store.session("done").metadata
        assert NOTES_KEY not in store.session("open").metadata


def test_an_oel_sample_has_the_noted_teachers_prompt_and_no_advantage(engine):
    turn = make_turn(prompt_messages=(QUESTION,))
    session = Session("s", "live", metadata={NOTES_KEY: NOTES})
    sample = oel_sample(7, turn, session, engine.encode)
    assert sample.teacher_prompt_ids == tuple(engine.encode(with_experience([QUESTION], NOTES)))
    assert sample.advantages == (0.0, 0.0) and sample.top_ids == ()
    assert (
        oel_sample(7, turn, Session("s", "live", metadata={NOTES_KEY: ""}), engine.encode) is None
    )
    judged = [(7, turn.replace(status=TurnStatus.JUDGED))]
    selection = select(
        judged,
        {"s": session},
        MethodConfig(name="oel"),
        weights={},
        current_version=0,
        max_staleness=4,
        encode=engine.encode,
    )
    assert selection.samples == (sample,) and selection.dropped == ()
    with pytest.raises(ValueError, match="needs `encode`"):
        select(
            judged,
            {"s": session},
            MethodConfig(name="oel"),
            weights={},
            current_version=0,
            max_staleness=4,
        )


def test_the_oel_term_is_the_tail_bin_kl_at_the_teachers_top_k():
    # one token; the teacher's top-2 at 0.25 and 0.5, the student's 0.5 and 0.25 there:
    # KL = 0.25 ln 2 (trainers/distillation.py's test), times w_opd 2
    sample = TrainSample(1, (1,), (7,), (-0.7,), (0.0,), 0, (1, 2))
    logs = [math.log(0.25), math.log(0.5)]
    teacher = TeacherTopK(torch.zeros(1, 0), torch.tensor([[8, 7]]), torch.tensor([logs]))
    current = torch.tensor([[math.log(0.5), math.log(0.25)]], requires_grad=True)
    settings = TopKSettings(k=2, subset="teacher", clip=None, weight=2.0, loss="oel")
    loss = topk_loss([sample], [current], [teacher], settings, total_tokens=1)
    assert loss.item() == pytest.approx(0.5 * math.log(2), abs=1e-6)


def test_a_step_of_oel_moves_the_student_toward_the_noted_teacher(engine, tmp_path):
    completion = engine.generate([QUESTION], sampling=SamplingParams(max_tokens=12, seed=5))
    teacher_prompt = engine.encode(with_experience([QUESTION], NOTES))
    sample = TrainSample(
        1,
        completion.prompt_token_ids,
        completion.completion_token_ids,
        completion.completion_logprobs,
        tuple(0.0 for _ in completion.completion_token_ids),
        0,
        tuple(teacher_prompt),
    )
    torch.manual_seed(0)
    settings = TopKSettings(k=50, subset="teacher", clip=None, loss="oel")
    config = TrainerConfig(lora_rank=4, lora_alpha=8, lr=1e-3)
    learner = Learner("tiny", config, tmp_path, settings)
    model = learner.model.get_base_model()
    with torch.no_grad():
        (teacher,) = teacher_topk(model, [sample], 50, 8)  # the adapter is still zero
    assert teacher.at_student.shape == (len(sample.completion_ids), 0)
    prompt, ids = list(sample.prompt_ids), list(sample.completion_ids)

    def kl():
        with torch.no_grad():
            _, _, (now,) = span_logprobs_at(
                model,
                [prompt + ids],
                [(0, len(prompt), len(prompt) + len(ids))],
                8,
                False,
                extra_ids=[teacher.ids],
            )
        return topk_loss([sample], [now], [teacher], settings, len(ids)).item()

    before = kl()
    assert before > 0
    metrics = learner.step([sample])
    assert metrics.loss == pytest.approx(before, rel=1e-3)  # the policy term is 0
    assert kl() < before
