"""The tool-call env's "shop" task set: generated shopping sums whose prices the agent
looks up (envs/toolcall/shop.py), played through the Gymnasium API."""

from __future__ import annotations

import json
import random

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

from envs.core import ERROR_PREFIX, IdleAgent, run_episode, tool_calls_message
from envs.registry import register_all
from envs.toolcall import shop
from envs.toolcall.env import ToolCallEnv
from envs.toolcall.tasks import load_task_set, resolve


@pytest.fixture(scope="module")
def env():
    made = ToolCallEnv(tasks="shop", split="test", max_turns=4)
    yield made
    made.close()


def _answer(total: object) -> dict:
    return tool_calls_message([("answer", {"total": total})])


def test_tasks_are_generated_the_same_from_their_seeds():
    # worked by hand: 5 candles at 16 and 3 kites at 11; hat and pear are on sale too
    task = shop.load_tasks("test")["shop/test/0002"]
    assert task.question == "Eli buys 5 candles and 3 kites. How much does Eli pay in total?"
    assert task.order == (("candle", 5), ("kite", 3))
    assert dict(task.prices) == {"candle": 16, "hat": 18, "kite": 11, "pear": 4}
    assert task.answer == 5 * 16 + 3 * 11 == 113
    again = shop._draw(random.Random("shop/test/2"))
    assert again == shop._draw(random.Random("shop/test/2"))


def test_splits_are_large_disjoint_and_numbered():
    train, test = shop.load_tasks("train"), shop.load_tasks("test")
    assert (len(train), len(test)) == (2000, 300)
    assert list(test)[:2] == ["shop/test/0000", "shop/test/0001"]
    assert not {shop._key(t) for t in train.values()} & {shop._key(t) for t in test.values()}
    for task in test.values():
        prices = dict(task.prices)
        assert task.answer == sum(q * prices[item] for item, q in task.order)
        assert len(task.order) in shop.ITEMS and len(prices) == len(task.order) + 2
        assert all(2 <= q <= 9 and prices[item] < 20 for item, q in task.order)
    assert set(load_task_set("shop", "all")) == set(train) | set(test)
    assert resolve("shop") == ("shop",)
    with pytest.raises(ValueError, match="unknown shop split"):
        shop.load_tasks("dev")


def test_reference_agent_solves_every_sampled_task_and_idle_none(env):
    ids = list(env.task_ids())[::5]  # 60 of the 300 held-out tasks
    for task_id in ids:
        result = run_episode(env, env.reference_agent(), task_id=task_id)
        assert (result.total_reward, result.turns, result.terminated) == (1.0, 3, True), task_id
    idle = run_episode(env, IdleAgent(), task_id=ids[0])
    assert (idle.total_reward, idle.truncated) == (0.0, True)
    assert env._info()["grade"]["error_type"].startswith("truncated")


def test_lookups_show_prices_only_and_the_total_is_graded_once(env):
    observation, info = env.reset(options={"task_id": "shop/test/0002"})
    assert {t["function"]["name"] for t in info["tools"]} == {"price", "calculator", "answer"}
    assert "16" not in json.dumps(observation)  # the prices are not in the question
    calls = [
        ("price", {"item": "candles", "quantity": 5}),
        ("price", {"item": "Kite", "quantity": 3}),
        ("price", {"item": "x", "quantity": 1}),
        ("price", {"item": "hat", "quantity": 0}),
        ("price", {"item": "hat", "quantity": 1.5}),
    ]
    observation, reward, terminated, _, _ = env.step(tool_calls_message(calls))
    contents = [m["content"] for m in observation]
    assert contents[:2] == ["80", "33"] and (reward, terminated) == (0.0, False)
    assert contents[2].startswith(ERROR_PREFIX) and "candle, hat, kite, pear" in contents[2]
    assert "at least 1" in contents[3] and "should be a JSON integer" in contents[4]
    assert "113" not in json.dumps(observation)
    unfinished = tool_calls_message([("calculator", {"expression": "5*16+"})])
    observation, _, _, _, _ = env.step(unfinished)
    assert observation[0]["content"].startswith(ERROR_PREFIX)
    # two answers in one message: the first ends the episode, the second is not run
    observation, reward, terminated, _, info = env.step(
        tool_calls_message([("answer", {"total": 112}), ("answer", {"total": 113})])
    )
    assert (reward, terminated) == (0.0, True) and info["grade"]["valid"] is False
    assert observation[0]["content"] == "incorrect" and "not run" in observation[1]["content"]


@pytest.mark.parametrize(
    ("action", "error"),
    [
        (_answer("113"), "should be"),  # the number as a string is malformed, not an answer
        (tool_calls_message([("answer", {})]), "missing required argument total"),
        (tool_calls_message([("total", {"answer": 113})]), "unknown tool 'total'"),
        ("The total is 113.", "no tool was called"),  # a reply is no answer
    ],
)
def test_malformed_or_missing_answers_score_nothing(env, action, error):
    env.reset(options={"task_id": "shop/test/0002"})
    observation, reward, terminated, truncated, _ = env.step(action)
    assert error in observation[0]["content"] and observation[0]["content"].startswith(ERROR_PREFIX)
    assert (reward, terminated, truncated) == (0.0, False, False)
    for _ in range(env.max_turns - 1):  # never answering runs the turn budget out
        observation, reward, terminated, truncated, info = env.step(action)
    assert (reward, terminated, truncated) == (0.0, False, True)
    assert info["grade"]["valid"] is False


def test_the_exact_total_alone_earns_the_reward(env):
    for total, reward in ((113, 1.0), (113.0, 1.0), (113.5, 0.0), (-113, 0.0)):
        env.reset(options={"task_id": "shop/test/0002"})
        _, got, terminated, _, info = env.step(_answer(total))
        assert (got, terminated, info["grade"]["valid"]) == (reward, True, reward == 1.0)


def test_registered_env_passes_check_env():
    register_all()
    made = gym.make("clawgym/ToolCall-v0", tasks="shop", split="test")
    check_env(made.unwrapped, skip_render_check=True)
    made.close()
