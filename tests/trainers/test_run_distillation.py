"""`trainers.run` with hint candidates chosen by the learner and with experience
distillation (`method=oel`), on chat with the tiny model (engine=embedded)."""

import pytest

from agents.config import EnvConfig
from agents.store import Store
from agents.trajectory import TurnStatus, TurnType
from tests.trainers.test_run import train
from trainers.config import RunConfig, validate

SEVERAL_HINTS = "judge.kind=tests.trainers.several_hints:SeveralHints"


@pytest.mark.parametrize("selection", ["overlap", pytest.param("longest", marks=pytest.mark.slow)])
def test_a_run_chooses_among_hint_candidates_by_its_selection_and_stores_them(tmp_path, selection):
    run_dir = tmp_path / selection
    summary = train(
        run_dir,
        "method=opd",
        SEVERAL_HINTS,
        "judge.votes=1",
        f"judge.hint_selection={selection}",
        "trainer.max_steps=2",
    )
    assert (summary["steps"], summary["adapter_version"]) == (2, 2)
    with Store(run_dir / "store.sqlite") as store:
        trained = [t.judgement for _, t in store.turns(status=TurnStatus.TRAINED)]
        judged = [t.judgement for _, t in store.turns(turn_type=TurnType.MAIN) if t.judgement]
    several = [j for j in trained if len(j.hint_candidates) > 1]
    assert several and all(j.teacher_logprobs for j in trained)
    for judgement in several:
        candidates = judgement.hint_candidates
        if selection == "overlap":
            scores = judgement.hint_overlaps
            assert len(scores) == len(candidates)
            assert judgement.hint == candidates[scores.index(max(scores))]
        else:
            assert judgement.hint == max(candidates, key=len) and not judgement.hint_overlaps
    # no judged turn is left waiting for a choice once the learner has seen it
    assert not any(j.awaits_hint_choice for j in trained)
    assert len(judged) >= len(trained)


def oel_run(run_dir, *overrides):
    summary = train(
        run_dir,
        "method=oel",
        "judge=feedback",
        "trainer.max_steps=2",
        "method.experience_max_tokens=16",
        *overrides,
    )
    assert (summary["method"], summary["steps"], summary["adapter_version"]) == ("oel", 2, 2)
    assert summary["first_loss"] > 0  # the reverse KL: no advantage, no policy loss
    with Store(run_dir / "store.sqlite") as store:
        trained = [t for _, t in store.turns(status=TurnStatus.TRAINED)]
        sessions = store.sessions(session_ids={t.session_id for t in trained})
        assert len(trained) == summary["turns_trained"] >= 4
        for session in sessions:  # each written once its episode ended, over all its turns
            mains = [t for t in store.session(session.session_id).turns if t.turn_type == "main"]
            assert session.status != "open" and session.metadata["experience"]
            assert session.metadata["experience_turns"] == len(mains)
    return summary


def test_oel_trains_two_steps_on_chat_from_each_sessions_notes(tmp_path):
    oel_run(tmp_path / "oel")


@pytest.mark.slow
@pytest.mark.vllm
def test_oel_trains_two_steps_on_chat_with_vllm_serving(tmp_path):
    summary = oel_run(tmp_path / "oel", "engine=vllm", "engine.max_lora_rank=8")
    assert summary["engine"] == "vllm"


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda c: setattr(c.judge, "hint_selection", "random"), "judge.hint_selection='random'"),
        (lambda c: setattr(c.judge, "overlap_k", 0), "judge.overlap_k must be >= 1"),
        (lambda c: setattr(c.method, "teacher_k", 0), "method.teacher_k"),
        (
            lambda c: (
                setattr(c.method, "name", "oel"),
                setattr(c.backend, "kind", "tinker"),
                setattr(c.backend, "api_key", "tml-x"),
            ),
            "method=oel takes the teacher's log-probs from the local learner",
        ),
    ],
)
def test_bad_distillation_values_say_the_fix(change, fragment):
    config = RunConfig(env={"chat": EnvConfig(id="clawgym/Chat-v0")})
    validate(config)
    change(config)
    with pytest.raises(ValueError, match=fragment):
        validate(config)
