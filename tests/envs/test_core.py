import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import envs  # noqa: F401
from envs.arith.env import ArithEnv
from envs.core import (
    ERROR_PREFIX,
    AgentEnv,
    EpisodeAborted,
    EpisodeEnd,
    IdleAgent,
    Reply,
    ToolResult,
    parse_action,
    run_episode,
    solved,
    tool_calls_message,
)
from envs.registry import registered_ids
from envs.tools import Tool, ToolCallError


def call(name, arguments, call_id="c1"):
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        ],
    }


# envs that play a server, checked against one in their own tests (tests/envs/openenv/)
NEEDS_A_SERVER = {"clawgym/OpenEnv-v0"}


@pytest.mark.parametrize("env_id", sorted(set(registered_ids()) - NEEDS_A_SERVER))
def test_every_registered_env_passes_gymnasiums_checker(env_id):
    env = gym.make(env_id)
    try:
        check_env(env.unwrapped)
    finally:
        env.close()


def test_reset_gives_messages_tools_and_the_chosen_task():
    env = ArithEnv()
    observation, info = env.reset(options={"task_id": "arith/train/0007"})
    assert info["task_id"] == "arith/train/0007"
    assert [m["role"] for m in observation] == ["system", "user"]
    assert {t["function"]["name"] for t in info["tools"]} == {"calculator", "submit"}
    assert env.observation_space.contains(observation)


def test_seeded_reset_picks_the_same_task_and_unknown_task_is_an_error():
    first = ArithEnv().reset(seed=3)[1]["task_id"]
    assert ArithEnv().reset(seed=3)[1]["task_id"] == first
    with pytest.raises(ValueError, match="unknown task_id"):
        ArithEnv().reset(options={"task_id": "arith/train/9999"})


@pytest.mark.parametrize(
    ("action", "fragment"),
    [
        (42, "not int"),
        ({"role": "user", "content": "hi"}, "role 'assistant'"),
        ({"role": "assistant", "content": ["x"]}, "content must be a string"),
        ({"role": "assistant", "content": "", "tool_calls": "calc"}, "tool_calls must be a list"),
    ],
)
def test_malformed_actions_are_error_observations_that_use_a_turn(action, fragment):
    env = ArithEnv(max_turns=2)
    env.reset(seed=0)
    observation, reward, terminated, truncated, info = env.step(action)
    assert observation[0]["role"] == "user"
    assert (
        observation[0]["content"].startswith(ERROR_PREFIX) and fragment in observation[0]["content"]
    )
    assert (reward, terminated, truncated, info["turn"]) == (0.0, False, False, 1)
    *_, truncated, info = env.step(action)
    assert truncated and info["turn"] == 2


@pytest.mark.parametrize(
    ("name", "arguments", "fragment"),
    [
        ("rm_rf", "{}", "unknown tool 'rm_rf'; the tools are: calculator, submit"),
        ("calculator", '{"expression": ', "not valid JSON"),
        ("calculator", "{}", "missing required argument expression"),
        ("submit", '{"answer": "twelve"}', "should be a JSON number"),
    ],
)
def test_bad_tool_calls_come_back_as_tool_errors(name, arguments, fragment):
    env = ArithEnv()
    env.reset(seed=0)
    observation, reward, terminated, truncated, _ = env.step(call(name, arguments))
    assert observation == [
        {"role": "tool", "tool_call_id": "c1", "name": name, "content": observation[0]["content"]}
    ]
    assert fragment in observation[0]["content"] and observation[0]["content"].startswith(
        ERROR_PREFIX
    )
    assert (reward, terminated, truncated) == (0.0, False, False)


def test_calls_after_the_one_that_ends_the_task_are_not_run():
    env = ArithEnv()
    env.reset(options={"task_id": "arith/train/0000"})
    answer = env.task.answer
    action = call("submit", f'{{"answer": {answer}}}')
    action["tool_calls"].append(
        {"id": "c2", "function": {"name": "submit", "arguments": '{"answer": -1}'}}
    )
    observation, reward, terminated, truncated, _ = env.step(action)
    assert [m["content"] for m in observation][0] == "correct"
    assert "not run" in observation[1]["content"]
    assert (reward, terminated, truncated) == (1.0, True, False)
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step("more")


def test_truncation_is_separate_from_termination():
    result = run_episode(ArithEnv(max_turns=4), IdleAgent(), seed=1)
    assert (result.turns, result.terminated, result.truncated, result.total_reward) == (
        4,
        False,
        True,
        0.0,
    )


def test_plain_string_is_content():
    assert parse_action("hello") == ("hello", [])
    with pytest.raises(ToolCallError):
        parse_action(None)


def test_max_turns_below_two_is_refused():
    with pytest.raises(ValueError, match="max_turns"):
        ArithEnv(max_turns=1)


def test_tool_calls_message_encodes_mappings_and_keeps_strings_as_sent():
    message = tool_calls_message([("calculator", {"expression": "1+2"}), ("submit", "{bad")], "c")
    assert message == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c_0",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "1+2"}'},
            },
            {"id": "c_1", "type": "function", "function": {"name": "submit", "arguments": "{bad"}},
        ],
    }
    assert parse_action(message)[1] == message["tool_calls"]


class _Ending(AgentEnv):
    """An env that records its episode-end hook's calls: `finish` ends the task, `crash`
    aborts the episode, and after every other action it says "looked"."""

    def __init__(self) -> None:
        super().__init__(max_turns=3)
        self.ends: list[tuple[bool, bool]] = []

    def task_ids(self):
        return ["only"]

    def _load_task(self, task_id):
        self.ends = []

    def _first_messages(self):
        return [{"role": "user", "content": "go"}]

    def _tools(self):
        return (
            Tool.from_function(self.finish),
            Tool.from_function(self.crash),
            Tool.from_function(self.bug),
        )

    def finish(self) -> ToolResult:
        """Ends the task."""
        return ToolResult("done", 1.0, terminated=True)

    def crash(self) -> str:
        """Fails as a browser that died does."""
        raise EpisodeAborted("the backend is gone")

    def bug(self) -> str:
        """Raises what no tool should (a bug of the env, an SDK's own error)."""
        raise RecursionError("maximum recursion depth exceeded")

    def _after_action(self):
        return Reply(({"role": "user", "content": "looked"},), 0.25)

    def _on_episode_end(self, terminated, truncated):
        self.ends.append((terminated, truncated))
        return EpisodeEnd(10.0, ({"role": "user", "content": "graded"},))


def test_episode_end_hook_runs_once_on_truncation_and_lands_in_that_step():
    env = _Ending()
    env.reset(seed=0)
    for _ in range(2):
        observation, reward, terminated, truncated, _ = env.step("thinking")
        assert env.ends == [] and (reward, terminated, truncated) == (0.25, False, False)
        assert observation[-1]["content"] == "looked"
    observation, reward, terminated, truncated, _ = env.step("thinking")
    assert env.ends == [(False, True)] and (reward, terminated, truncated) == (10.25, False, True)
    assert [m["content"] for m in observation][-2:] == ["looked", "graded"]


def test_episode_end_hook_runs_once_on_termination_after_the_tools_results():
    env = _Ending()
    env.reset(seed=0)
    env.step("thinking")
    observation, reward, terminated, truncated, _ = env.step(call("finish", "{}"))
    assert env.ends == [(True, False)] and (reward, terminated, truncated) == (11.0, True, False)
    assert [m["content"] for m in observation] == ["done", "graded"]  # no "looked": it ended
    env.reset(seed=0)
    assert env.ends == []


def test_an_aborted_episode_is_truncated_with_the_reason_and_still_ends_once():
    env = _Ending()
    env.reset(seed=0)
    observation, reward, terminated, truncated, info = env.step(call("crash", "{}"))
    assert env.ends == [(False, True)] and (reward, terminated, truncated) == (10.0, False, True)
    assert observation[0]["content"] == ERROR_PREFIX + "the backend is gone; the episode is over"
    assert info["aborted"] == "the backend is gone" and info["turn"] == 1
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step("more")


def test_any_exception_of_a_tool_or_the_end_hook_ends_the_episode_instead_of_raising():
    env = _Ending()
    env.reset(seed=0)
    observation, reward, terminated, truncated, info = env.step(call("bug", "{}"))
    assert (terminated, truncated) == (False, True) and env.ends == [(False, True)]
    assert info["failed"] == "RecursionError: maximum recursion depth exceeded"
    assert observation[0]["content"].startswith("[error] the environment failed (RecursionError")

    def broken_end(terminated, truncated):
        raise OSError("the sandbox's directory is gone")

    env.reset(seed=0)
    env._on_episode_end = broken_end
    _, reward, terminated, truncated, info = env.step(call("finish", "{}"))
    assert (reward, terminated) == (1.0, True) and info["failed"].startswith("OSError")


def test_only_full_reward_solves_a_task():
    assert solved(1.0) and solved(0.9999999999) and solved(2.0)
    assert not solved(0.99) and not solved(0.5) and not solved(0.0) and not solved(-1.0)
