"""The agent loop, in process (`DirectSeat`) and through the proxy (`ProxySeat`), as the
trainer rolls out: the same episode must be stored the same way either way, and a bad
episode (a history past the context, an environment that dies) is stored as data."""

import contextlib
from typing import Any

import gymnasium as gym
import httpx
import pytest

from agents.engines.base import SamplingParams
from agents.engines.embedded import EmbeddedEngine
from agents.rollout import ELIDED, elide_oldest, run_episode
from agents.seats import DirectSeat, ProxySeat
from agents.store import Store
from agents.trajectory import SessionStatus, TurnStatus
from envs.arith.env import ArithEnv
from tests.agents.serving import running

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, seed=3)
SMALL_CONTEXT = 512
"""Tokens of context of `small_engine`: a few turns of `_LongOutputsEnv`."""


def play(seat, env=None, seed=0, sampling=GREEDY):
    return run_episode(
        env or ArithEnv(max_turns=3),
        seat,
        env_id="clawgym/Arith-v0",
        seed=seed,
        group_id="g0",
        sampling=sampling,
    )


@contextlib.contextmanager
def _proxy(engine, path):
    """A proxy over `engine` on a fresh store at `path`: (seat, store, base URL, the
    headers of an admin request)."""
    with Store(path) as store, running(engine, store) as (url, proxy):
        with contextlib.closing(ProxySeat(url, admin_key=proxy.admin_key)) as seat:
            admin = {
                "Authorization": f"Bearer {proxy.admin_key}",
                "Content-Type": "application/json",
            }
            yield seat, store, url, admin


@pytest.fixture
def proxied(tiny_engine, tmp_path):
    """A proxy over the tiny engine on a fresh store: (seat, store, base URL, admin
    headers)."""
    with _proxy(tiny_engine, tmp_path / "proxy.sqlite") as served:
        yield served


@pytest.fixture(scope="module")
def small_engine():
    """The tiny model with a context of `SMALL_CONTEXT` tokens."""
    engine = EmbeddedEngine("tiny", threads=2, context_length=SMALL_CONTEXT)
    yield engine
    engine.close()


def test_episode_is_stored_turn_by_turn_with_next_states(tiny_engine, tmp_path):
    with Store(tmp_path / "store.sqlite") as store:
        summary = play(
            DirectSeat(tiny_engine, store), sampling=SamplingParams(max_tokens=16, seed=3)
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
    assert sum(len(t.completion_token_ids) for t in session.turns) == summary.completion_tokens


def test_through_the_proxy_an_episode_stores_what_the_direct_path_stores(
    tiny_engine, tmp_path, proxied
):
    seat, proxy_store, _, _ = proxied
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
        # the second episode reuses the first one's KV (the prefix cache): equal to rounding
        assert proxied_turn.completion_logprobs == pytest.approx(
            direct_turn.completion_logprobs, abs=1e-5
        )
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


def test_a_task_past_the_context_ends_the_episode_truncated(proxied):
    seat, store, _, _ = proxied
    summary = play(seat, env=_OneTurnEnv("count " * 200_000))
    assert summary.turns == 0  # the task itself is never elided
    assert (summary.status, summary.error) == (SessionStatus.TRUNCATED, "context")
    session = store.session(summary.session_id)
    assert session.status == SessionStatus.TRUNCATED
    assert session.metadata["end_reason"] == "context"


def test_an_environment_that_fails_mid_episode_ends_it_as_failed_data(proxied):
    seat, store, _, _ = proxied
    summary = play(seat, env=_OneTurnEnv("2 + 2?", fail=True))
    assert "the sandbox died" in (summary.error or "") and summary.turns == 0
    assert summary.status == SessionStatus.FAILED
    session = store.session(summary.session_id)
    assert session.status == SessionStatus.FAILED and len(session.turns) == 1
    assert session.turns[0].next_state == ()  # nothing followed the reply
    assert session.metadata["end_reason"] == summary.error


class _EndlessEnv(_OneTurnEnv):
    """Answers every reply and never ends the task."""

    def step(self, action):
        return [{"role": "user", "content": "go on"}], 0.0, False, False, {}


def test_a_server_that_fails_mid_episode_interrupts_it_and_drops_its_turns(
    proxied, tiny_engine, monkeypatch
):
    seat, store, _, _ = proxied
    served = tiny_engine.agenerate
    calls = 0

    async def fails_after_one(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls > 1:
            raise RuntimeError("the engine's worker died")
        return await served(*args, **kwargs)

    monkeypatch.setattr(tiny_engine, "agenerate", fails_after_one)
    summary = play(seat, env=_EndlessEnv("2 + 2?"))
    # the episode is over, the caller is not: it sees why in the summary
    assert (summary.status, summary.turns) == (SessionStatus.INTERRUPTED, 1)
    assert (summary.error or "").startswith("the episode broke off")
    session = store.session(summary.session_id)
    assert session.status == SessionStatus.INTERRUPTED
    assert session.metadata["end_reason"] == summary.error
    # its first turn is stored, and never trained on: no fault of the policy's
    assert [t.status for t in session.turns] == [TurnStatus.DROPPED]


def test_a_normal_end_has_no_error_and_says_how_the_environment_ended(proxied):
    seat, store, _, _ = proxied
    ended = play(seat, env=_OneTurnEnv("2 + 2?"))
    assert (ended.status, ended.error, ended.terminated) == (SessionStatus.DONE, None, True)
    assert store.session(ended.session_id).metadata["end_reason"] == "terminated"
    budget = play(seat, env=ArithEnv(max_turns=2), sampling=SamplingParams(max_tokens=4))
    if not budget.terminated:  # the tiny model's noise rarely answers at all
        assert (budget.status, budget.error) == (SessionStatus.DONE, None)
        assert store.session(budget.session_id).metadata["end_reason"] == "max_turns"


# -- context management --------------------------------------------------------------------

LONG = "x" * 100


def test_elision_takes_the_oldest_observation_and_spares_the_task_and_the_last():
    call = {"id": "c0", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    history = [
        {"role": "system", "content": "sys " * 30},
        {"role": "user", "content": "the task " * 20},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c0", "content": LONG},
        {"role": "assistant", "content": "next"},
        {"role": "user", "content": "short"},  # shorter than the marker: eliding it saves nothing
        {"role": "user", "content": [{"type": "text", "text": LONG}]},
        {"role": "assistant", "content": "last"},
        {"role": "tool", "tool_call_id": "c1", "content": LONG},  # the last observation
    ]
    first = elide_oldest(history)
    assert first is not None and _changed(history, first) == [3]
    assert first[3] == {"role": "tool", "tool_call_id": "c0", "content": ELIDED}
    second = elide_oldest(first)
    assert second is not None and _changed(first, second) == [6]
    assert second[6] == {"role": "user", "content": ELIDED}
    assert elide_oldest(second) is None  # nothing left but what is never elided
    assert history[3]["content"] == LONG  # the history given is left as it was
    assert elide_oldest(history[:2]) is None  # before the first reply nothing is an output
    assert elide_oldest(history, marker="[cut]")[3]["content"] == "[cut]"


def _changed(before, after):
    assert len(before) == len(after)
    return [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]


class _LongOutputsEnv(gym.Env[Any, Any]):
    """An agentic env whose every step answers with a long output (`sizes[i]` words: a
    file, a log), and ends the task after the last."""

    def __init__(self, sizes):
        self.sizes = sizes

    def reset(self, *, seed=None, options=None):
        self.turn = 0
        task = [
            {"role": "system", "content": "You are a careful agent."},
            {"role": "user", "content": "Read the outputs, then say what they count."},
        ]
        return task, {"tools": [], "task_id": "long"}

    def step(self, action):
        self.turn += 1
        output = f"output {self.turn}: " + "word " * self.sizes[self.turn - 1]
        return [{"role": "user", "content": output}], 0.0, self.turn == len(self.sizes), False, {}


def test_a_history_past_the_context_is_elided_and_stored_as_the_policy_saw_it(
    small_engine, tmp_path
):
    sampling = SamplingParams(temperature=0.0, max_tokens=8, seed=3)
    env = _LongOutputsEnv([100] * 6)
    with _proxy(small_engine, tmp_path / "proxy.sqlite") as (seat, store, _, _):
        summary = play(seat, env=env, sampling=sampling)
        session = store.session(summary.session_id)
    assert (summary.status, summary.error, summary.turns) == (SessionStatus.DONE, None, 6)
    assert session.metadata["end_reason"] == "terminated"
    elided = [
        [i for i, m in enumerate(t.prompt_messages) if m["content"] == ELIDED]
        for t in session.turns
    ]
    assert not elided[0] and elided[-1]
    # oldest first: the outputs (every other message from the 4th on) up to some turn's
    assert elided[-1] == list(range(3, 3 + 2 * len(elided[-1]), 2))
    for turn, earlier, later in zip(session.turns, elided, elided[1:], strict=False):
        assert set(earlier) <= set(later)  # later turns go on from the elided history
        assert turn.next_state and ELIDED not in [m["content"] for m in turn.next_state]
    for turn in session.turns:
        # token-exact: the ids are the chat template's of the (elided) history sent
        assert list(turn.prompt_token_ids) == small_engine.encode(turn.prompt_messages)
        assert len(turn.prompt_token_ids) < SMALL_CONTEXT
        assert turn.prompt_messages[1]["content"].startswith("Read the outputs")
        assert turn.prompt_messages[-1]["content"] != ELIDED  # the last output is whole
    with Store(tmp_path / "direct.sqlite") as direct_store:
        direct = play(DirectSeat(small_engine, direct_store), env=env, sampling=sampling)
        direct_turns = direct_store.session(direct.session_id).turns
    assert [t.prompt_token_ids for t in direct_turns] == [t.prompt_token_ids for t in session.turns]


def test_an_output_that_alone_is_past_the_context_truncates_the_episode(small_engine, tmp_path):
    sampling = SamplingParams(temperature=0.0, max_tokens=8, seed=3)
    with _proxy(small_engine, tmp_path / "proxy.sqlite") as (seat, store, _, _):
        summary = play(seat, env=_LongOutputsEnv([100, 100, 600, 100]), sampling=sampling)
        session = store.session(summary.session_id)
    assert (summary.status, summary.error, summary.turns) == (SessionStatus.TRUNCATED, "context", 3)
    assert session.status == SessionStatus.TRUNCATED
    assert session.metadata["end_reason"] == "context"
    assert len(session.turns) == 3 and session.outcome_reward == summary.total_reward
    last = session.turns[-1]
    assert last.next_state[0]["content"].startswith("output 3: ")  # stored whole


def test_each_turn_answer_names_its_index_and_rewards_land_by_it(proxied):
    seat, store, _, _ = proxied
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
        ("/admin/sessions", {"session_id": "s", "env_id": "e", "metadata": "w"}, 400),
        ("/admin/sessions", {"session_id": "s", "env_id": "e", "metadata": {"w": [1]}}, 400),
        (
            "/admin/sessions",
            {"session_id": "s", "env_id": "e", "metadata": {"end_reason": "x"}},
            400,
        ),
        ("/admin/sessions", {"session_id": "s", "env_id": "e", "metadata": {"w": "x" * 2001}}, 400),
        ("/admin/sessions/missing/end", {"messages": []}, 404),
        ("/admin/sessions/s0/end", {"rewards": {"zero": 1.0}}, 400),
        ("/admin/sessions/s0/end", {"rewards": {"0": float("nan")}}, 400),
        ("/admin/sessions/s0/end", {"status": "open"}, 400),
        ("/admin/sessions/s0/end", {"status": ["done"]}, 400),
        ("/admin/sessions/s0/end", {"status": "truncated", "reason": 3}, 400),
        ("/admin/sessions/s0/end", {"messages": "hi"}, 400),
    ],
)
def test_the_episode_routes_refuse_bad_input_clearly(proxied, path, body, status):
    _, store, url, headers = proxied
    with httpx.Client(base_url=url.removesuffix("/v1"), headers=headers) as admin:
        assert admin.post("/admin/sessions", json={"session_id": "s0", "env_id": "e"}).is_success
        answer = admin.post(path, content=_json(body))
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["message"]
    assert store.session_status("s0") == SessionStatus.OPEN  # nothing half-written


def test_a_session_opens_once_and_ends_once(proxied):
    _, store, url, headers = proxied
    opened = {"session_id": "s1", "env_id": "clawgym/Arith-v0", "group_id": "g"}
    end = {"messages": [], "outcome_reward": 0.5, "status": "failed"}
    truncated = {"status": "truncated", "reason": "context " * 1000}
    with httpx.Client(base_url=url.removesuffix("/v1"), headers=headers) as admin:
        assert admin.post("/admin/sessions", json=opened).status_code == 200
        assert admin.post("/admin/sessions", json=opened).status_code == 409
        assert admin.post("/admin/sessions/s1/end", json=end).status_code == 200
        assert admin.post("/admin/sessions/s1/end", json=end).status_code == 409
        assert admin.post("/admin/sessions", json={**opened, "session_id": "s2"}).is_success
        assert admin.post("/admin/sessions/s2/end", json=truncated).status_code == 200
    session = store.session("s1")
    assert (session.status, session.outcome_reward, session.group_id) == ("failed", 0.5, "g")
    assert "end_reason" not in session.metadata
    session = store.session("s2")
    assert session.status == "truncated"
    assert session.metadata["end_reason"] == truncated["reason"][:2000]  # a long reason is cut


def _json(body):
    import json

    return json.dumps(body, allow_nan=True)


class _BrokenEnv(_OneTurnEnv):
    def reset(self, *, seed=None, options=None):
        raise ConnectionError("the user model is down")


def test_an_environment_that_cannot_reset_gives_an_empty_failed_episode(proxied):
    seat, store, _, _ = proxied
    summary = play(seat, env=_BrokenEnv("unused"))
    assert summary.turns == 0 and "the user model is down" in (summary.error or "")
    assert store.sessions() == []  # nothing was played, nothing is recorded


def test_a_caller_may_name_the_session_and_keep_metadata_with_it(proxied):
    seat, store, _, _ = proxied
    summary = run_episode(
        ArithEnv(max_turns=2),
        seat,
        env_id="arith",
        seed=0,
        sampling=SamplingParams(max_tokens=4),
        session_id="named-by-caller",
        metadata={"worker": "node-a/pid 7", "attempt": 1},
    )
    assert summary.session_id == "named-by-caller"
    session = store.session("named-by-caller")
    assert session.metadata["worker"] == "node-a/pid 7" and session.metadata["attempt"] == 1
