"""tau2's model-driven user over an OpenAI-compatible endpoint (`user="model"`), reached
with the real `openai` client over real HTTP."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator, Sequence
from typing import Any

import gymnasium as gym
import pytest
from fastapi import FastAPI

from agents.serving.server import uvicorn_in_thread
from envs.core import ERROR_PREFIX
from envs.registry import register_all
from envs.toolcall.env import ToolCallEnv
from envs.toolcall.taubench import guidelines
from envs.toolcall.user import UserModelError, make_user

TASK = "tau2/retail/0"


class StandInUserModel:
    """Stands in for a user model (no model can play a customer on this CPU machine in a
    test): an OpenAI-compatible chat-completions server that answers with `lines` in order,
    then repeats the last one, and keeps every request it got."""

    def __init__(self, lines: Sequence[str]):
        self.lines = list(lines)
        self.requests: list[dict[str, Any]] = []
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self._complete)

    async def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        self.requests.append(body)
        text = self.lines[min(len(self.requests), len(self.lines)) - 1]
        return {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
        }


@contextlib.contextmanager
def serving(model: StandInUserModel) -> Iterator[str]:
    """Serves the stand-in on a free loopback port from a thread; yields its base URL."""
    with uvicorn_in_thread(model.app, access_log=False) as port:
        yield f"http://127.0.0.1:{port}/v1"


def closed_port_url() -> str:
    """A loopback URL nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


def model_env(url: str, **kwargs: Any) -> ToolCallEnv:
    return ToolCallEnv(
        tasks="tau2_retail", split="all", user="model", user_base_url=url, user_model="u", **kwargs
    )


def test_the_model_user_speaks_its_lines_ends_on_its_stop_token_and_is_graded():
    lines = ["I want to return something.", "It's the order I placed last week.", "###STOP###"]
    model = StandInUserModel(lines)
    register_all()
    with serving(model) as url:
        env = gym.make(
            "clawgym/ToolCall-v0",
            tasks="tau2_retail",
            split="all",
            user="model",
            user_base_url=url,
            user_model="stand-in",
        ).unwrapped
        observation, _ = env.reset(options={"task_id": TASK})
        assert observation[-1] == {"role": "user", "content": lines[0]}
        observation, _, terminated, truncated, _ = env.step("Which order is it?")
        assert observation == [{"role": "user", "content": lines[1]}]
        assert not (terminated or truncated)
        observation, reward, terminated, truncated, info = env.step("Done. Anything else?")
        env.close()
    assert observation == [{"role": "user", "content": "###STOP###"}]
    assert terminated and not truncated and info["turn"] == 2
    # tau2's own evaluators graded it: nothing was done, and this task needs a change
    assert info["grade"]["reward"] == reward == 0.0 and info["grade"]["breakdown"]
    # the model read tau2's guidelines and the task's scenario, the roles swapped
    assert [r["model"] for r in model.requests] == ["stand-in"] * 3
    system = model.requests[0]["messages"][0]
    scenario = str(env.tasks[TASK].data.user_scenario)
    assert system["role"] == "system"
    assert guidelines() in system["content"] and scenario in system["content"]
    assert model.requests[-1]["messages"][1:] == [
        {"role": "user", "content": "Hi! How can I help you today?"},
        {"role": "assistant", "content": lines[0]},
        {"role": "user", "content": "Which order is it?"},
        {"role": "assistant", "content": lines[1]},
        {"role": "user", "content": "Done. Anything else?"},
    ]


def test_the_model_user_stops_after_user_max_turns():
    model = StandInUserModel(["Still there?"])
    with serving(model) as url:
        env = model_env(url, user_max_turns=2)
        env.reset(options={"task_id": TASK})
        assert env.step("One moment.")[0] == [{"role": "user", "content": "Still there?"}]
        observation, _, terminated, _, info = env.step("Another moment.")
        env.close()
    assert observation == [{"role": "user", "content": "###STOP###"}]
    assert terminated and "reward" in info["grade"] and len(model.requests) == 2


def test_an_unreachable_user_model_fails_the_reset_with_the_endpoint_named():
    url = closed_port_url()
    env = model_env(url)
    with pytest.raises(UserModelError, match=f"the user model 'u' at {url} failed"):
        env.reset(options={"task_id": TASK})
    env.close()


def test_a_user_model_lost_mid_episode_ends_it_truncated_with_the_reason():
    model = StandInUserModel(["I want to return something."])
    with serving(model) as url:
        env = model_env(url)
        env.reset(options={"task_id": TASK})
    observation, reward, terminated, truncated, info = env.step("Which order is it?")
    env.close()
    assert (reward, terminated, truncated) == (0.0, False, True)
    assert info["aborted"].startswith(f"the user model 'u' at {url} failed")
    assert observation[0]["content"].startswith(ERROR_PREFIX + "the user model")
    assert info["grade"]["valid"] is False and "aborted" in info["grade"]["error_type"]


def test_user_settings_are_checked():
    with pytest.raises(ValueError, match="needs user_base_url"):
        make_user("model", model="u")
    with pytest.raises(ValueError, match="one of scripted, model"):
        make_user("simulated")
    with pytest.raises(ValueError, match="user_base_url apply to user='model' only"):
        ToolCallEnv(tasks="tau2_retail", user_base_url="http://127.0.0.1:1/v1")
    with pytest.raises(ValueError, match="max_turns"):
        make_user("model", "http://127.0.0.1:1/v1", "u", max_turns=0)
