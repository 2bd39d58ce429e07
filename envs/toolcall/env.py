"""`clawgym/ToolCall-v0`: function calling graded by the benchmarks' own checkers.

Task sets (`envs.toolcall.tasks`) are chosen by the `tasks` kwarg; each task is one of:

- BFCL single-turn: the item's messages and its functions as tools; the first reply is the
  answer. Its tool calls are graded by bfcl-eval's AST checker (relevance categories: only
  whether it calls a function); reward 1 or 0, and the episode ends.
- BFCL multi-turn: the user's turns one by one; each reply with tool calls is one step,
  executed by BFCL's stateful backends inside a sandbox (`envs.toolcall.multiturn`); a
  reply without tool calls ends the turn. After the last turn BFCL's multi-turn checker
  grades state and responses; an episode cut short by the turn budget scores 0, as BFCL
  scores a model it had to stop.
- tau2-bench (retail, airline): the domain's policy and tools over its database; a
  simulated user (`envs.toolcall.user`) answers every reply without tool calls: by default
  a script that states the reason for calling and stops after the agent's first answer;
  with `user="model"`, a model behind an OpenAI-compatible endpoint playing the task's user
  scenario under tau2's user guidelines, as tau2 intends. When the user ends the
  conversation (a stop token, or `user_max_turns` messages said) or the agent says
  `###STOP###`, tau2's evaluators grade it; cut short by the turn budget it scores 0, as
  tau2 scores a premature end. A user model that fails mid-episode ends the episode,
  truncated, with the reason in `info["aborted"]`; one that fails on the opening message
  makes `reset` raise `UserModelError` (there is no episode without it).
- shop (`envs.toolcall.shop`): a shopping list whose prices the agent looks up with
  `price`, sums with `calculator` and gives with `answer`; the first answer ends the
  episode, 1 if it is the exact total, else 0. A reply without tool calls is told to call
  the tools; cut short by the turn budget, the episode scores 0.

Calls to unknown tools, with arguments that are not JSON or that do not fit the tool's
schema, come back as error observations (BFCL single-turn grades the reply all the same,
as BFCL would). BFCL multi-turn checks no value types, as BFCL's execution checks none:
a value of another type runs on the backend, which answers it as it does in BFCL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from envs.core import (
    ERROR_PREFIX,
    Action,
    AgentEnv,
    EpisodeAborted,
    EpisodeEnd,
    Message,
    Reply,
    error_message,
    tool_calls_message,
)
from envs.sandbox import close_held
from envs.toolcall import bfcl, shop
from envs.toolcall.multiturn import BackendEntry, BackendSandbox
from envs.toolcall.tasks import ToolCallTask, load_task_set
from envs.toolcall.taubench import STOP_TOKENS, Tau2Session, communicate_info, plain_schema
from envs.toolcall.taubench import reference_actions as tau2_actions
from envs.toolcall.user import TauUser, UserModelError, is_stop, make_user
from envs.tools import Tool, ToolCallError

TAU2_SYSTEM = (
    "You are a customer service agent. Help the user by following the policy below, "
    "using the tools when you need data or must change something. Ask the user for any "
    "information you lack.\n\n<policy>\n{policy}\n</policy>"
)


class ToolCallEnv(AgentEnv):
    """Function-calling tasks from BFCL v4 and tau2-bench.

    Args:
        tasks: task set names, comma-separated or a list (see `envs.toolcall.tasks`).
        split: "train", "test" (held out) or "all".
        max_turns: assistant messages allowed per episode.
        sandbox: the backend of BFCL multi-turn's sandboxes ("bwrap", "docker", "auto").
        user: tau2's user: "scripted" (states the reason for calling, stops after the
            agent's first answer), "model" (a model at `user_base_url` plays the task's
            user), or a `TauUser` object (e.g. `ModelUser(engine)`).
        user_base_url: "model": the user model's OpenAI-compatible endpoint, e.g.
            "http://127.0.0.1:8000/v1".
        user_model: "model": the model name the endpoint serves.
        user_api_key: "model": the endpoint's key (None: `$OPENAI_API_KEY` or none).
        user_max_turns: "model": the most messages the user model writes per episode, its
            opening included; then the user stops (None: the turn budget alone bounds it).
        user_timeout: "model": seconds one request to the user model may take.
    """

    def __init__(
        self,
        tasks: str | Sequence[str] = "bfcl_single_turn",
        split: str = "train",
        max_turns: int = 30,
        sandbox: str = "bwrap",
        user: str | TauUser = "scripted",
        user_base_url: str | None = None,
        user_model: str | None = None,
        user_api_key: str | None = None,
        user_max_turns: int | None = None,
        user_timeout: float = 60.0,
    ):
        super().__init__(max_turns=max_turns)
        self.task_set = tasks
        self.split = split
        self.tasks = load_task_set(tasks, split)
        if not self.tasks:
            raise ValueError(f"task set {tasks!r} has no tasks in split {split!r}")
        self.sandbox_backend = sandbox
        self.user: TauUser = (
            make_user(user, user_base_url, user_model, user_api_key, user_max_turns, user_timeout)
            if isinstance(user, str)
            else user
        )
        self.task: ToolCallTask | None = None
        self.turn_index = 0
        self._tools_now: list[Tool] = []
        self._backends: BackendSandbox | None = None
        self._decoded: list[list[list[str]]] = []
        self._session: Tau2Session | None = None
        self._shop: shop.ShopSession | None = None
        self._conversation: list[Message] = []
        self._grade: dict[str, Any] | None = None

    # -- hooks ---------------------------------------------------------------------------
    def task_ids(self) -> Sequence[str]:
        return list(self.tasks)

    def _load_task(self, task_id: str) -> None:
        close_held(self, "_backends")
        self.task = self.tasks[task_id]
        self.turn_index = 0
        self._grade = None
        self._session = None
        self._shop = None
        if self.task.kind == "shop":
            self._shop = shop.ShopSession(self.task.data)
            self._tools_now = self._shop.tools()
            return
        if self.task.kind == "tau2":
            self._session = Tau2Session(self.task.category, self.task.data)
            self._tools_now = [self._tau2_tool(s) for s in self._session.tool_schemas()]
            return
        self._tools_now = [self._bfcl_tool(doc) for doc in self.task.data["function"]]
        if self.task.kind == "bfcl_multi":
            self._decoded = [[]]
            self._backends = BackendSandbox(self.sandbox_backend)

    def _first_messages(self) -> list[Message]:
        assert self.task is not None
        if self._shop is not None:
            return self._shop.messages()
        if self._session is None:
            return [dict(m) for m in self.task.data["question"][0]]
        opening = self.user.opening(self._scenario())
        self._session.say("user", opening)
        self._conversation = [{"role": "user", "content": opening}]
        system = TAU2_SYSTEM.format(policy=self._session.policy)
        return [{"role": "system", "content": system}, {"role": "user", "content": opening}]

    def _tools(self) -> Sequence[Tool]:
        return tuple(self._tools_now)

    def reference_agent(self) -> ToolCallReferenceAgent:
        return ToolCallReferenceAgent(self)

    def _info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"split": self.split}
        if self.task is not None:
            info["category"] = self.task.category
        if self._grade is not None:
            info["grade"] = dict(self._grade)
        return info

    # -- tools ---------------------------------------------------------------------------
    def _bfcl_tool(self, doc: dict[str, Any]) -> Tool:
        assert self.task is not None
        schema = bfcl.tool_schema(doc, self.task.category)
        return Tool(bfcl.tool_name(doc["name"]), doc.get("description", ""), schema, _noted)

    def _tau2_tool(self, function: dict[str, Any]) -> Tool:
        name = function["name"]

        def run(**arguments: Any) -> str:
            assert self._session is not None
            return self._session.call(name, arguments)

        parameters = plain_schema(function["parameters"])
        return Tool(name, function.get("description", ""), parameters, run)

    # -- replies with tool calls ---------------------------------------------------------
    def _run_calls(self, calls: list[Message]) -> tuple[list[Message], float, bool]:
        assert self.task is not None
        if self.task.kind == "bfcl_multi":
            return self._run_backend_step(calls), 0.0, False
        observation, reward, terminated = super()._run_calls(calls)
        if self.task.kind == "bfcl_single":
            return observation, self._grade_single(bfcl.decode_calls(calls)), True
        if self._shop is not None and self._shop.answered is not None:
            total = self._shop.answered
            self._grade = {"valid": bool(reward), "answer": total, "error_type": None}
        return observation, reward, terminated

    def _run_backend_step(self, calls: list[Message]) -> list[Message]:
        """One BFCL step: the valid calls run together in the sandbox, in order."""
        assert self.task is not None and self._backends is not None
        contents: list[str | None] = []
        strings: list[str] = []
        for call in calls:
            function = call.get("function") or {}
            try:
                name, arguments = self._bind(function.get("name"), function.get("arguments"))
            except ToolCallError as error:
                contents.append(ERROR_PREFIX + str(error))
                continue
            contents.append(None)
            strings.append(bfcl.call_string(name, arguments))
        if strings:
            entry = _backend_entry(self.task.data)
            history = [step for turn in self._decoded for step in turn]
            results = iter(self._backends.execute(entry, history, strings))
            self._decoded[-1].append(strings)
            contents = [c if c is not None else next(results) for c in contents]
        return [
            {
                "role": "tool",
                "tool_call_id": str(call.get("id") or f"call_{i}"),
                "name": (call.get("function") or {}).get("name"),
                "content": content,
            }
            for i, (call, content) in enumerate(zip(calls, contents, strict=True))
        ]

    def _bind(self, name: Any, arguments: Any) -> tuple[str, dict[str, Any]]:
        """A multi-turn call's name and arguments, checked as far as BFCL's execution checks
        them, since BFCL's ground truth relies on what it leaves unchecked:

        - values of another type than the doc declares run (the backends are Python, which
          checks no annotations): `close_ticket(ticket_id='ticket_001')` is item 173's
          ground truth in every multi-turn category, though the doc declares an integer;
        - a function of the item's backends that a later turn adds runs before that turn
          (BFCL runs any method of the backends): miss_func item 49's ground truth calls
          `tail` at turn 1, and its doc is added only at turn 3.

        An unknown function, arguments that are not a JSON object, and unknown or missing
        arguments are errors."""
        tool = self._tool_index.get(name) if isinstance(name, str) else None
        if tool is None and isinstance(name, str) and self.task is not None:
            held_out = [doc for docs in self.task.data["held_out"].values() for doc in docs]
            tools = {t.name: t for t in map(self._bfcl_tool, held_out)}
            tool = tools.get(name)
        if tool is None:
            known = ", ".join(self._tool_index) or "none"
            raise ToolCallError(f"unknown tool {name!r}; the tools are: {known}")
        return tool.name, _untyped(tool).bind(arguments)

    # -- replies without tool calls ------------------------------------------------------
    def _on_reply(self, content: str) -> Reply:
        assert self.task is not None
        if self.task.kind == "bfcl_single":
            reward = self._grade_single(None)
            return Reply((_verdict(reward),), reward, terminated=True)
        if self.task.kind == "bfcl_multi":
            return self._next_turn()
        if self.task.kind == "shop":
            return Reply((error_message(shop.NO_CALL),))
        return self._tau2_reply(content)

    def _next_turn(self) -> Reply:
        assert self.task is not None and self._backends is not None
        item = self.task.data
        self.turn_index += 1
        if self.turn_index >= len(item["question"]):
            check = self._backends.grade(_backend_entry(item), self._decoded, item["answer"])
            self._grade = {"valid": check.valid, "error_type": check.error_type}
            return Reply((_verdict(float(check.valid)),), float(check.valid), terminated=True)
        self._decoded.append([])
        messages = [dict(m) for m in item["question"][self.turn_index]]
        added = item["held_out"].get(str(self.turn_index))
        if added:
            self._tools_now += [self._bfcl_tool(doc) for doc in added]
            self._tool_index = {tool.name: tool for tool in self._tools_now}
            messages = messages or [{"role": "user", "content": bfcl.ADDED_FUNCTIONS_PROMPT}]
        return Reply(tuple(messages))

    def _tau2_reply(self, content: str) -> Reply:
        assert self._session is not None
        self._session.say("assistant", content)
        self._conversation.append({"role": "assistant", "content": content})
        if STOP_TOKENS[0] in content:
            return Reply((), self._grade_tau2(), terminated=True)
        try:
            text = self.user.reply(self._scenario(), self._conversation)
        except UserModelError as error:  # no fault of the agent's: the episode just stops
            self._grade = {"valid": False, "error_type": f"aborted: {error}"}
            raise EpisodeAborted(str(error)) from error
        self._session.say("user", text)
        self._conversation.append({"role": "user", "content": text})
        message: Message = {"role": "user", "content": text}
        if is_stop(text):
            return Reply((message,), self._grade_tau2(), terminated=True)
        return Reply((message,))

    # -- grading -------------------------------------------------------------------------
    def _grade_single(self, decoded: bfcl.Decoded | None) -> float:
        assert self.task is not None
        check = bfcl.check_single_turn(self.task.data, self.task.category, decoded)
        self._grade = {"valid": check.valid, "error_type": check.error_type}
        return float(check.valid)

    def _grade_tau2(self) -> float:
        assert self._session is not None
        grade = self._session.grade()
        self._grade = {"reward": grade.reward, "breakdown": dict(grade.breakdown)}
        return grade.reward

    def _scenario(self) -> str:
        assert self.task is not None
        return str(self.task.data.user_scenario)

    def _on_episode_end(self, terminated: bool, truncated: bool) -> EpisodeEnd:
        """A truncated episode nobody graded scores 0, as the benchmarks score a model they
        had to stop; either way the task's backends are done."""
        if truncated and self._grade is None:
            self._grade = {"valid": False, "error_type": "truncated: the turn budget ran out"}
        close_held(self, "_backends")
        return EpisodeEnd()

    # -- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        close_held(self, "_backends")
        super().close()


def _untyped(tool: Tool) -> Tool:
    """The tool with its parameters' names and required ones, but no types."""
    names = tool.parameters.get("properties", {})
    required = tool.parameters.get("required", [])
    untyped = {"type": "object", "properties": {n: {} for n in names}, "required": required}
    return Tool(tool.name, tool.description, untyped, tool.function)


def _noted(**arguments: Any) -> str:
    return "call received"


def _verdict(reward: float) -> Message:
    return {"role": "user", "content": "graded: correct" if reward > 0 else "graded: incorrect"}


def _backend_entry(item: dict[str, Any]) -> BackendEntry:
    return BackendEntry(item["id"], item["initial_config"], tuple(item["involved_classes"]))


class ToolCallReferenceAgent:
    """Scripted reference solver. It reads the answer key from the env, as an oracle does:
    BFCL single-turn, the ground truth's calls; multi-turn, each turn's ground-truth calls
    in one step, then a reply that ends the turn; tau2, the task's reference actions one per
    message, then a message with what the agent must tell the user; shop, the calls
    `shop.reference_action` makes from the tools' results."""

    def __init__(self, env: ToolCallEnv):
        self.env = env
        self._issued: set[int] = set()
        self._actions: list[tuple[str, dict[str, Any]]] = []

    def act(self, observation: list[Message], info: dict[str, Any]) -> Action:
        task = self.env.task
        assert task is not None
        if "turn" not in info:  # a new episode
            self._issued = set()
            self._actions = tau2_actions(task.data) if task.kind == "tau2" else []
        if task.kind == "shop":
            return shop.reference_action(task.data, observation)
        if task.kind == "bfcl_single":
            calls = bfcl.reference_calls(task.data, task.category)
            if not calls:
                return "None of these functions fits the request."
            return tool_calls_message(calls)
        if task.kind == "bfcl_multi":
            return self._multi_turn(task)
        if self._actions:
            return tool_calls_message([self._actions.pop(0)])
        return " ".join(communicate_info(task.data)) or "Your request is done."

    def _multi_turn(self, task: ToolCallTask) -> Action:
        turn = self.env.turn_index
        truth = task.data["answer"][turn]
        if turn in self._issued or not truth:
            return "Done."
        self._issued.add(turn)
        docs = task.data["function"] + [d for ds in task.data["held_out"].values() for d in ds]
        return tool_calls_message([bfcl.parse_call_string(call, docs) for call in truth])
