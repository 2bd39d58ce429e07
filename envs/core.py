"""The environment contract every clawgym env follows (docs/architecture.md, "Contracts":
Environment).

An episode is a conversation. `reset` returns the first messages the agent sees and, in
`info["tools"]`, the OpenAI tool schemas it may call; `step` takes one assistant message
(OpenAI format, or a plain string as its content) and returns the new user / tool messages.

A subclass implements a few hooks: `task_ids`, `_load_task`, `_first_messages`, `_tools`
and, when plain-text replies mean something, `_on_reply`. Two more are optional:
`_after_action`, what the agent sees after every action beyond the tools' results (GUI: the
page again), and `_on_episode_end`, run once when an episode ends however it ended (grade
what a truncated episode left, release what it held). The base class parses actions,
validates tool calls, turns every mistake into an error observation that uses up a turn,
and keeps `terminated` (the task ended) apart from `truncated` (the turn budget ran out, or
a tool or hook raised `EpisodeAborted`: the episode could not go on). No subclass needs to
override `step`. An env whose tasks have a scripted solver returns it from
`reference_agent`: its episodes become demonstrations for supervised fine-tuning.
"""

from __future__ import annotations

import copy
import json
import logging
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import gymnasium as gym
import numpy as np

from envs.tools import Tool, ToolCallError

logger = logging.getLogger(__name__)

Message = dict[str, Any]
Action = Message | str

ERROR_PREFIX = "[error] "
_ROLES = frozenset({"system", "user", "assistant", "tool"})


def solved(total_reward: float) -> bool:
    """Whether an episode solved its task: its full reward (1), the rule for pass@1 in
    held-out evaluation and on the leaderboard. Any reward above 0 is not enough:
    InterCode-ALFA's tasks give partial credit for output like the gold command's, and a few
    GUI tasks a little for a near miss; counting those made the held-out pass@1 of the Terminal
    runs 0.57-0.63 where the leaderboard counted 0.03-0.05 of the same policies' episodes
    solved."""
    return total_reward >= 1.0 - 1e-9


@dataclass(frozen=True)
class ToolResult:
    """What a tool returns when it does more than produce text."""

    content: str
    reward: float = 0.0
    terminated: bool = False


@dataclass(frozen=True)
class Reply:
    """The environment's own answer to an action: to an assistant message without tool
    calls (`_on_reply`), or after any action (`_after_action`)."""

    messages: tuple[Message, ...]
    reward: float = 0.0
    terminated: bool = False


@dataclass(frozen=True)
class EpisodeEnd:
    """What the end of an episode adds to its last step (`AgentEnv._on_episode_end`): a
    reward (a truncated episode's grade) and messages after the step's own. Info needs no
    field here: the step reads `_info()` after the hook, so a grade it records shows."""

    reward: float = 0.0
    messages: tuple[Message, ...] = ()


class EpisodeAborted(RuntimeError):
    """Raised by a tool or a hook during a step when the episode cannot go on through no
    fault of the action (a browser that crashed, a user model that cannot be reached).

    The step ends the episode, truncated, with reward 0, the reason as its one error
    observation and in `info["aborted"]`: a bad episode is data, and a training run that
    meets one goes on. `_on_episode_end` still runs. Any other exception out of a tool or
    a hook ends the step the same way, and one out of `_on_episode_end` ends it with no
    added reward; both are logged with their traceback and named in `info["failed"]` as
    well (the env's fault rather than the action's: a rollout records the episode failed,
    not trained on).
    """


class MessagesSpace(gym.Space[list[Message]]):
    """Lists of chat messages: what an `AgentEnv` observes."""

    def __init__(self, seed: int | np.random.Generator | None = None):
        super().__init__(shape=None, dtype=None, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, list) and all(
            isinstance(m, dict)
            and m.get("role") in _ROLES
            and isinstance(m.get("content"), str | list | type(None))
            for m in x
        )

    def sample(self, mask: Any = None, probability: Any = None) -> list[Message]:
        return [{"role": "user", "content": _random_text(self.np_random)}]

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MessagesSpace)


class AssistantActionSpace(gym.Space[Action]):
    """Assistant messages. Samples are deliberately rough (unknown tools, bad JSON, plain
    text) so that random agents exercise an env's error paths."""

    def __init__(self, tool_names: Sequence[str] = (), seed: int | None = None):
        super().__init__(shape=None, dtype=None, seed=seed)
        self.tool_names = tuple(tool_names)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) or (isinstance(x, dict) and x.get("role") == "assistant")

    def sample(self, mask: Any = None, probability: Any = None) -> Action:
        rng = self.np_random
        kind = int(rng.integers(3))
        if kind == 0:
            return _random_text(rng)
        names = [*self.tool_names, "no_such_tool"]
        name = names[int(rng.integers(len(names)))]
        arguments = _random_text(rng) if kind == 1 else json.dumps({"x": _random_text(rng)})
        return tool_calls_message([(name, arguments)])

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AssistantActionSpace) and other.tool_names == self.tool_names


def _random_text(rng: np.random.Generator) -> str:
    alphabet = string.ascii_letters + string.digits + ' {}":,'
    return "".join(alphabet[i] for i in rng.integers(len(alphabet), size=int(rng.integers(1, 24))))


def tool_calls_message(
    calls: Sequence[tuple[str, Mapping[str, Any] | str]], id_prefix: str = "call"
) -> Message:
    """An assistant message calling tools, in OpenAI's format: `(name, arguments)` pairs,
    the arguments a mapping (JSON-encoded here) or a JSON string sent as it is; the calls'
    ids are `{id_prefix}_0`, `{id_prefix}_1`, ..."""
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"{id_prefix}_{index}",
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
            for index, (name, arguments) in enumerate(calls)
        ],
    }


def error_message(text: str) -> Message:
    """A user-role message telling the agent what went wrong with its last action."""
    return {"role": "user", "content": ERROR_PREFIX + text}


class AgentEnv(gym.Env[list[Message], Action]):
    """Base class of every clawgym environment; see the module docstring for the hooks.

    Args:
        max_turns: assistant messages allowed per episode; the episode is truncated after.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, *, max_turns: int = 10):
        if max_turns < 2:
            raise ValueError(f"max_turns must be at least 2, got {max_turns}")
        self.max_turns = max_turns
        self.observation_space = MessagesSpace()
        self.action_space = AssistantActionSpace()
        self.task_id: str | None = None
        self._turn = 0
        self._finished = True
        self._tool_index: dict[str, Tool] = {}

    # -- hooks -------------------------------------------------------------------------
    def task_ids(self) -> Sequence[str]:
        """Ids of the tasks this env instance draws from (its split)."""
        raise NotImplementedError

    def _load_task(self, task_id: str) -> None:
        """Prepares the episode for one task (sandboxes, pages, simulated users...)."""
        raise NotImplementedError

    def _first_messages(self) -> list[Message]:
        """The messages that open the episode."""
        raise NotImplementedError

    def _tools(self) -> Sequence[Tool]:
        """The tools of the current task."""
        return ()

    def _on_reply(self, content: str) -> Reply:
        """Handles an assistant message without tool calls. By default it nudges."""
        names = ", ".join(self._tool_index) or "no tools"
        return Reply((error_message(f"no tool was called; the tools are: {names}"),))

    def _after_action(self) -> Reply:
        """What the agent sees after an action that did not end the task, even a malformed
        one, after the tools' results: its messages are appended and its reward added, and
        it may end the task (GUI: the page again, or how the page ended the episode on its
        own). By default nothing."""
        return Reply(())

    def _on_episode_end(self, terminated: bool, truncated: bool) -> EpisodeEnd:
        """Runs once per episode, in the step that ends it, whichever way it ended: for
        what only the end knows (grading the work of an episode the turn budget cut short)
        or releases (a task's backends). Its reward is added to that step's and its messages
        follow the step's observation. By default nothing."""
        return EpisodeEnd()

    def _info(self) -> dict[str, Any]:
        """Extra info of the current task; must be deterministic for a given seed."""
        return {}

    def reference_agent(self) -> ScriptedAgent | None:
        """The scripted solver of the task just reset (an oracle: it may read the answer
        key), or None where the task has none. Its episodes are the demonstrations that
        supervised fine-tuning learns from (`agents.demonstrations`) and the reference
        row of the leaderboard."""
        return None

    # -- gymnasium API -----------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        super().reset(seed=seed)
        options = options or {}
        task_id = options.get("task_id")
        if task_id is None:
            ids = self.task_ids()
            task_id = ids[int(self.np_random.integers(len(ids)))]
        elif task_id not in set(self.task_ids()):
            raise ValueError(f"unknown task_id {task_id!r} for {type(self).__name__}")
        self.task_id = task_id
        self._load_task(task_id)
        self._tool_index = {tool.name: tool for tool in self._tools()}
        self.action_space = AssistantActionSpace(tuple(self._tool_index))
        self._turn = 0
        self._finished = False
        info = {"task_id": task_id, "tools": [t.schema for t in self._tool_index.values()]}
        return copy.deepcopy(self._first_messages()), info | self._info()

    def step(self, action: Action) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        if self._finished:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        self._turn += 1
        aborted: str | None = None
        failed: str | None = None  # the env's own fault, not the action's (a bug, a dead sandbox)
        try:
            observation, reward, terminated = self._act(action)
            if not terminated:
                after = self._after_action()
                observation += after.messages
                reward, terminated = reward + after.reward, after.terminated
        except EpisodeAborted as error:
            logger.warning("episode of %s cut off: %s", self.task_id, error)
            aborted = str(error)
            observation = [error_message(f"{aborted}; the episode is over")]
            reward, terminated = 0.0, False
        except Exception as error:  # a bad episode is data: no action may end the caller
            logger.exception("episode of %s cut off by an error of the env", self.task_id)
            aborted = failed = f"{type(error).__name__}: {error}"
            observation = [error_message(f"the environment failed ({failed}); the episode is over")]
            reward, terminated = 0.0, False
        truncated = not terminated and (aborted is not None or self._turn >= self.max_turns)
        self._finished = terminated or truncated
        if self._finished:
            try:
                end = self._on_episode_end(terminated, truncated)
            except Exception as error:
                logger.exception("the end of an episode of %s failed", self.task_id)
                failed = failed or f"{type(error).__name__}: {error}"
                end = EpisodeEnd()
            observation += end.messages
            reward += end.reward
        info = {"task_id": self.task_id, "turn": self._turn} | self._info()
        if aborted is not None:
            info["aborted"] = aborted
        if failed is not None:
            info["failed"] = failed
        return copy.deepcopy(observation), float(reward), terminated, truncated, info

    def _act(self, action: Action) -> tuple[list[Message], float, bool]:
        """The action's own outcome: its tools' results, or the reply to its text."""
        try:
            content, calls = parse_action(action)
        except ToolCallError as error:
            return [error_message(str(error))], 0.0, False
        if calls:
            return self._run_calls(calls)
        reply = self._on_reply(content)
        return list(reply.messages), reply.reward, reply.terminated

    def _run_calls(self, calls: list[Message]) -> tuple[list[Message], float, bool]:
        observation: list[Message] = []
        reward, terminated = 0.0, False
        for index, call in enumerate(calls):
            call_id = str(call.get("id") or f"call_{index}")
            function = call.get("function") or {}
            name = function.get("name")
            if terminated:
                content = ERROR_PREFIX + "not run: an earlier call in this message ended the task"
            else:
                result = self._call_tool(name, function.get("arguments"))
                content = result.content
                reward += result.reward
                terminated = result.terminated
            observation.append(
                {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}
            )
        return observation, reward, terminated

    def _call_tool(self, name: Any, arguments: Any) -> ToolResult:
        tool = self._tool_index.get(name) if isinstance(name, str) else None
        if tool is None:
            known = ", ".join(self._tool_index) or "none"
            return ToolResult(f"{ERROR_PREFIX}unknown tool {name!r}; the tools are: {known}")
        try:
            result = tool.function(**tool.bind(arguments))
        except ToolCallError as error:
            return ToolResult(ERROR_PREFIX + str(error))
        return result if isinstance(result, ToolResult) else ToolResult(str(result))


def parse_action(action: Any) -> tuple[str, list[Message]]:
    """Splits an action into its text and tool calls; raises `ToolCallError` if malformed."""
    if isinstance(action, str):
        return action, []
    if not isinstance(action, dict):
        raise ToolCallError(
            f"an action is an assistant message or a string, not {type(action).__name__}"
        )
    if action.get("role", "assistant") != "assistant":
        raise ToolCallError(f"an action must have role 'assistant', not {action.get('role')!r}")
    content = action.get("content") or ""
    if not isinstance(content, str):
        raise ToolCallError("an assistant message's content must be a string")
    calls = action.get("tool_calls") or []
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise ToolCallError("tool_calls must be a list of {id, type, function: {name, arguments}}")
    return content, calls


class ScriptedAgent(Protocol):
    """An agent written in code: reference solvers, do-nothing baselines."""

    def act(self, observation: list[Message], info: dict[str, Any]) -> Action: ...


class IdleAgent:
    """The do-nothing baseline: answers every turn with an empty message."""

    def act(self, observation: list[Message], info: dict[str, Any]) -> Action:
        return ""


@dataclass(frozen=True)
class EpisodeResult:
    """Outcome of one scripted episode."""

    task_id: str
    total_reward: float
    turns: int
    terminated: bool
    truncated: bool


def run_episode(
    env: gym.Env[list[Message], Action],
    agent: ScriptedAgent,
    task_id: str | None = None,
    seed: int | None = None,
) -> EpisodeResult:
    """Plays one episode of `env` with a scripted agent."""
    observation, info = env.reset(seed=seed, options={"task_id": task_id} if task_id else None)
    total, turns = 0.0, 0
    terminated = truncated = False
    while not (terminated or truncated):
        observation, reward, terminated, truncated, step_info = env.step(
            agent.act(observation, info)
        )
        info = info | step_info
        total += float(reward)
        turns += 1
    return EpisodeResult(str(info["task_id"]), total, turns, terminated, truncated)
