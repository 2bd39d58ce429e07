"""The agent loop, in process (`DirectSeat`) and through the proxy (`ProxySeat`), as the
trainer rolls out: the same episode must be stored the same way either way."""

from typing import Any

import gymnasium as gym
import httpx
import pytest

from agents.engines.base import SamplingParams
from agents.rollout import DirectSeat, ProxySeat, run_episode
from agents.store import Store
from agents.trajectory import SessionStatus
from envs.arith.env import ArithEnv
from tests.agents.serving import running

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, seed=3)


def play(seat, env=None, seed=0, sampling=GREEDY):
    return run_episode(
        env or ArithEnv(max_turns=3),
        seat,
        env_id="clawgym/Arith-v0",
        seed=seed,
        group_id="g0",
        sampling=sampling,
    )


@pytest.fixture
def proxied(tiny_engine, tmp_path):
    """A proxy over the tiny engine on a fresh store: (seat, store, base URL)."""
    with Store(tmp_path / "proxy.sqlite") as store, running(tiny_engine, store) as (url, _):
        seat = ProxySeat(url)
        yield seat, store, url
        seat.close()


def test_episode_is_stored_turn_by_turn_with_next_states(tiny_engine, tmp_path):
    with Store(tmp_path / "store.sqlite") as store:
        summary = play(DirectSeat(tiny_engine, store), sampling=SamplingParams(max_tokens=16))
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
    assert sum(len(t.completion_token_ids) for t in session.turns) == summary.completion_tokens


def test_through_the_proxy_an_episode_stores_what_the_direct_path_stores(
    tiny_engine, tmp_path, proxied
):
    seat, proxy_store, _ = proxied
    with Store(tmp_path / "direct.sqlite") as direct_store:
        direct = play(DirectSeat(tiny_engine, direct_store))
        direct_session = direct_store.session(direct.session_id)
    through = play(seat)
    session = proxy_store.session(through.session_id)
    assert (session.env_id, session.task_id, session.group_id) == (
        "clawgym/Arith-v0",
        direct_session.task_id,
        "g0",
    )
    assert session.status == SessionStatus.DONE
    assert session.outcome_reward == direct_session.outcome_reward == through.total_reward
    assert len(session.turns) == len(direct_session.turns) == 3
    for proxied_turn, direct_turn in zip(session.turns, direct_session.turns, strict=True):
        assert proxied_turn.turn_type == "main" and proxied_turn.index == direct_turn.index
        assert proxied_turn.prompt_token_ids == direct_turn.prompt_token_ids
        assert proxied_turn.completion_token_ids == direct_turn.completion_token_ids
        assert proxied_turn.completion_logprobs == direct_turn.completion_logprobs
        assert proxied_turn.env_reward == direct_turn.env_reward
        assert [m["content"] for m in proxied_turn.next_state] == [
            m["content"] for m in direct_turn.next_state
        ]
    assert (through.prompt_tokens, through.completion_tokens) == (
        direct.prompt_tokens,
        direct.completion_tokens,
    )


class _OneTurnEnv(gym.Env[Any, Any]):
    """An env whose first prompt is `prompt` and whose step may raise (for the failures a
    real env meets: a task past the context, a sandbox that dies)."""

    def __init__(self, prompt: str, fail: bool = False):
        self.prompt, self.fail = prompt, fail

    def reset(self, *, seed=None, options=None):
        return [{"role": "user", "content": self.prompt}], {"tools": [], "task_id": "t0"}

    def step(self, action):
        if self.fail:
            raise RuntimeError("the sandbox died")
        return [{"role": "user", "content": "ok"}], 1.0, True, False, {}


def test_a_prompt_past_the_context_ends_the_episode_as_failed_data(proxied):
    seat, store, _ = proxied
    summary = play(seat, env=_OneTurnEnv("count " * 200_000))
    assert summary.turns == 0 and "context" in (summary.error or "")
    assert store.session(summary.session_id).status == SessionStatus.FAILED


def test_an_environment_that_fails_mid_episode_ends_it_as_failed_data(proxied):
    seat, store, _ = proxied
    summary = play(seat, env=_OneTurnEnv("2 + 2?", fail=True))
    assert "the sandbox died" in (summary.error or "") and summary.turns == 0
    session = store.session(summary.session_id)
    assert session.status == SessionStatus.FAILED and len(session.turns) == 1
    assert session.turns[0].next_state == ()  # nothing followed the reply


def test_each_turn_answer_names_its_index_and_rewards_land_by_it(proxied):
    seat, store, _ = proxied
    summary = play(seat, env=ArithEnv(max_turns=2), sampling=SamplingParams(max_tokens=8))
    turns = store.session(summary.session_id).turns
    assert [t.index for t in turns] == [0, 1]
    assert all(t.env_reward is not None for t in turns)
    assert sum(t.env_reward for t in turns) == summary.total_reward


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/admin/sessions", {"session_id": "s", "env_id": ""}, 400),
        ("/admin/sessions", {"session_id": "s\n", "env_id": "e"}, 400),
        ("/admin/sessions", {"session_id": "s", "env_id": "e", "task_id": 3}, 400),
        ("/admin/sessions/missing/end", {"messages": []}, 404),
        ("/admin/sessions/s0/end", {"rewards": {"zero": 1.0}}, 400),
        ("/admin/sessions/s0/end", {"rewards": {"0": float("nan")}}, 400),
        ("/admin/sessions/s0/end", {"status": "open"}, 400),
        ("/admin/sessions/s0/end", {"messages": "hi"}, 400),
    ],
)
def test_the_episode_routes_refuse_bad_input_clearly(proxied, path, body, status):
    _, store, url = proxied
    admin = url.removesuffix("/v1")
    assert httpx.post(
        admin + "/admin/sessions", json={"session_id": "s0", "env_id": "e"}
    ).is_success
    answer = httpx.post(admin + path, content=_json(body))
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["message"]
    assert store.session_status("s0") == SessionStatus.OPEN  # nothing half-written


def test_a_session_opens_once_and_ends_once(proxied):
    _, store, url = proxied
    admin = url.removesuffix("/v1")
    opened = {"session_id": "s1", "env_id": "clawgym/Arith-v0", "group_id": "g"}
    assert httpx.post(admin + "/admin/sessions", json=opened).status_code == 200
    assert httpx.post(admin + "/admin/sessions", json=opened).status_code == 409
    end = {"messages": [], "outcome_reward": 0.5, "status": "failed"}
    assert httpx.post(admin + "/admin/sessions/s1/end", json=end).status_code == 200
    assert httpx.post(admin + "/admin/sessions/s1/end", json=end).status_code == 409
    session = store.session("s1")
    assert (session.status, session.outcome_reward, session.group_id) == ("failed", 0.5, "g")


def _json(body):
    import json

    return json.dumps(body, allow_nan=True)


class _BrokenEnv(_OneTurnEnv):
    def reset(self, *, seed=None, options=None):
        raise ConnectionError("the user model is down")


def test_an_environment_that_cannot_reset_gives_an_empty_failed_episode(proxied):
    seat, store, _ = proxied
    summary = play(seat, env=_BrokenEnv("unused"))
    assert summary.turns == 0 and "the user model is down" in (summary.error or "")
    assert store.sessions() == []  # nothing was played, nothing is recorded
