import dataclasses

import pytest

from agents.trajectory import Turn, TurnType


def make_turn(**changes):
    fields = dict(
        session_id="s",
        index=0,
        turn_type=TurnType.MAIN,
        prompt_messages=({"role": "user", "content": "hi"},),
        prompt_token_ids=(1, 2, 3),
        completion_token_ids=(4, 5),
        completion_logprobs=(-0.5, -1.25),
        completion={"role": "assistant", "content": "yo"},
        policy_version=0,
    )
    return Turn(**(fields | changes))


def test_turn_is_frozen_and_replace_copies():
    turn = make_turn()
    with pytest.raises(dataclasses.FrozenInstanceError):
        turn.index = 3  # type: ignore[misc]
    assert turn.replace(index=3).index == 3 and turn.index == 0


def test_one_logprob_per_completion_token_is_enforced():
    with pytest.raises(ValueError, match="2 log-probs for 3 completion tokens"):
        make_turn(completion_token_ids=(4, 5, 6))
    with pytest.raises(ValueError, match="index"):
        make_turn(index=-1)
