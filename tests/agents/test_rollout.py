from agents.engines.base import SamplingParams
from agents.rollout import run_episode
from agents.store import Store
from agents.trajectory import SessionStatus
from envs.arith.env import ArithEnv


def test_episode_is_stored_turn_by_turn_with_next_states(tiny_engine, tmp_path):
    env = ArithEnv(max_turns=3)
    with Store(tmp_path / "store.sqlite") as store:
        summary = run_episode(
            env,
            tiny_engine,
            store,
            env_id="clawgym/Arith-v0",
            seed=0,
            group_id="g0",
            sampling=SamplingParams(max_tokens=16, seed=0),
        )
        session = store.session(summary.session_id)
    assert session.status == SessionStatus.DONE and session.group_id == "g0"
    assert session.task_id == summary.task_id and session.outcome_reward == summary.total_reward
    assert len(session.turns) == summary.turns == 3
    for turn, following in zip(session.turns, session.turns[1:], strict=False):
        # the next prompt is this prompt, this reply and its next state, nothing re-tokenized
        assert following.prompt_messages == (
            *turn.prompt_messages,
            turn.completion,
            *turn.next_state,
        )
        assert (
            following.prompt_token_ids[: len(turn.prompt_token_ids) - 3]
            == turn.prompt_token_ids[:-3]
        )
    assert all(t.next_state and t.env_reward is not None for t in session.turns)
    assert sum(t.completion_token_ids.__len__() for t in session.turns) == summary.completion_tokens
