"""clawgym envs served over OpenEnv, played by OpenEnv's own client (`GenericEnvClient`,
from PyPI's openenv-core): the same seed and actions give the same observations and rewards
as the env in-process; sessions are separate and closed; bad input gets an error."""

from __future__ import annotations

import json
from typing import Any

import gymnasium as gym
import httpx
import pytest
from openenv.core.generic_client import GenericEnvClient
from websockets.sync.client import connect

from envs.core import IdleAgent, ScriptedAgent
from envs.openenv.__main__ import main
from envs.openenv.protocol import ChatEnvClient
from envs.openenv.server import build_app, is_loopback, serve
from envs.toolcall.env import ToolCallReferenceAgent


def play_both(base_url: str, local: Any, agent: ScriptedAgent, seed: int) -> list[Any]:
    """Plays one episode remotely and the same one locally, step by step, checking both
    agree; returns the remote steps' (reward, terminated, truncated)."""
    with GenericEnvClient(base_url).sync() as client:
        remote = client.reset(seed=seed).observation
        observation, info = local.reset(seed=seed)
        assert (remote["messages"], remote["info"]) == (observation, json.loads(json.dumps(info)))
        steps, done = [], False
        while not done:
            action = agent.act(observation, info)
            result = client.step({"message": action})
            observation, reward, terminated, truncated, step_info = local.step(action)
            info = info | step_info
            got = result.observation
            assert got["messages"] == observation and got["info"] == step_info
            assert (result.reward, got["terminated"], got["truncated"]) == (
                reward,
                terminated,
                truncated,
            )
            assert result.done == (terminated or truncated)
            steps.append((result.reward, got["terminated"], got["truncated"]))
            done = result.done
    return steps


@pytest.mark.parametrize("seed", [0, 7])
def test_arith_over_openenv_matches_the_local_env(serve, seed):
    served = serve("clawgym/Arith-v0")
    local = gym.make("clawgym/Arith-v0").unwrapped
    assert play_both(served.base_url, local, local.reference_agent(), seed)[-1] == (1.0, 1, 0)
    idle = play_both(served.base_url, local, IdleAgent(), seed)
    assert sum(r for r, *_ in idle) == 0.0 and idle[-1][2]


def test_toolcall_over_openenv_matches_the_local_env(serve):
    kwargs = {"tasks": "bfcl_single_turn", "split": "all"}
    served = serve("clawgym/ToolCall-v0", kwargs)
    local = gym.make("clawgym/ToolCall-v0", **kwargs).unwrapped
    for seed in (1, 2):
        steps = play_both(served.base_url, local, ToolCallReferenceAgent(local), seed)
        assert sum(r for r, *_ in steps) == 1.0, seed
        play_both(served.base_url, local, IdleAgent(), seed)  # BFCL's irrelevance: idle may win


def test_terminal_over_openenv_matches_the_local_env_in_bwrap(serve):
    from envs.terminal.env import TerminalReferenceAgent

    kwargs = {"tasks": "tbench", "split": "all", "sandbox": "bwrap", "max_turns": 3}
    served = serve("clawgym/Terminal-v0", kwargs)
    local = gym.make("clawgym/Terminal-v0", **kwargs).unwrapped
    try:
        steps = play_both(served.base_url, local, TerminalReferenceAgent(local), 0)
        assert sum(r for r, *_ in steps) == 1.0
    finally:
        local.close()


def test_each_session_has_its_own_env_closed_when_it_ends(serve):
    served = serve("clawgym/Arith-v0")
    first, second = (
        GenericEnvClient(served.base_url).sync(),
        GenericEnvClient(served.base_url).sync(),
    )
    with first, second:
        a = first.reset(seed=0).observation["info"]["task_id"]
        b = second.reset(seed=1).observation["info"]["task_id"]
        assert a != b
        first.step({"message": "no answer here"})
        assert first.state()["task_id"] == a and first.state()["step_count"] == 1
        assert second.state()["task_id"] == b and second.state()["step_count"] == 0
        assert served.sessions.active_sessions == 2
    with ChatEnvClient(served.base_url).sync() as client:
        client.reset(seed=0)
        assert served.sessions.active_sessions == 1
    assert served.sessions.active_sessions == 0  # ChatEnvClient waits for the server's close


def exchange(ws: Any, message: Any) -> dict[str, Any]:
    ws.send(message if isinstance(message, str) else json.dumps(message))
    return json.loads(ws.recv(timeout=30))


def test_malformed_messages_get_errors_and_the_server_keeps_serving(serve):
    served = serve("clawgym/Arith-v0")
    ws_url = served.base_url.replace("http", "ws") + "/ws"
    with connect(ws_url) as ws:
        cases = [
            ("{not json", "INVALID_JSON"),
            ({"type": "teleport"}, "UNKNOWN_TYPE"),
            ({"type": "step", "data": {"message": "hi"}}, "EXECUTION_ERROR"),  # before reset
            ({"type": "step", "data": {"msg": "hi"}}, "VALIDATION_ERROR"),
            ({"type": "reset", "data": {"options": {"task_id": "arith/none"}}}, "EXECUTION_ERROR"),
        ]
        for message, code in cases:
            reply = exchange(ws, message)
            assert (reply["type"], reply["data"]["code"]) == ("error", code), message
        assert "finished episode" in exchange(ws, cases[2][0])["data"]["message"]
        reply = exchange(ws, {"type": "reset", "data": {"seed": 0}})
        assert reply["type"] == "observation" and reply["data"]["observation"]["messages"]
    with GenericEnvClient(served.base_url).sync() as client:
        assert client.reset(seed=0).observation["info"]["task_id"]
    assert httpx.get(served.base_url + "/health").status_code == 200


def test_a_server_with_a_key_refuses_requests_without_it(serve):
    served = serve("clawgym/Arith-v0", api_key="s3cret")
    assert httpx.get(served.base_url + "/health").status_code == 401
    headers = {"Authorization": "Bearer s3cret"}
    assert httpx.get(served.base_url + "/health", headers=headers).status_code == 200
    for client in (GenericEnvClient(served.base_url), ChatEnvClient(served.base_url, "wrong")):
        with pytest.raises(ConnectionError):
            client.sync().connect()
    with ChatEnvClient(served.base_url, "s3cret").sync() as client:
        assert client.reset(seed=0).observation.info["task_id"]


def test_a_non_loopback_bind_needs_a_key(monkeypatch, capsys):
    with pytest.raises(ValueError, match="API key"):
        serve("clawgym/Arith-v0", host="0.0.0.0")
    monkeypatch.delenv("CLAWGYM_OPENENV_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "clawgym/Arith-v0", "--host", "0.0.0.0", "--port", "1"])
    assert exit_info.value.code == 2 and "API key" in capsys.readouterr().err
    assert [
        is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "example.org")
    ] == [
        True,
        True,
        True,
        False,
        False,
    ]


def test_unknown_ids_and_bad_kwargs_are_refused_at_start():
    with pytest.raises(ValueError, match="unknown env id"):
        build_app("clawgym/Nope-v0")
    with pytest.raises(ValueError, match="cannot be made"):
        build_app("clawgym/Arith-v0", {"no_such_kwarg": 1})
    with pytest.raises(SystemExit):
        main(["serve", "clawgym/Arith-v0", "--kwargs", "[1]"])
