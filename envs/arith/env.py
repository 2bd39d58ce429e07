"""`clawgym/Arith-v0`: arithmetic word problems solved with a `calculator` tool.

The smallest real environment: it proves the `AgentEnv` contract end to end. The agent
reads a word problem, may call `calculator`, and answers with `submit` (or, for policies
that cannot emit tool calls, a plain reply ending in `Answer: <number>`). A correct answer
earns 1 and ends the episode; a wrong one earns 0 and ends it too.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from envs.arith.tasks import ArithTask, evaluate, load_tasks
from envs.core import (
    Action,
    AgentEnv,
    Message,
    Reply,
    ToolResult,
    error_message,
    tool_calls_message,
)
from envs.tools import Tool

SYSTEM_PROMPT = (
    "You solve arithmetic word problems. Use the calculator tool for arithmetic, then call "
    "submit with the final number. Without tools, end your reply with 'Answer: <number>'."
)
# "Answer: 12", "the answer is 12", GSM8K's "#### 12" and "\boxed{12}" all state a final answer.
_TEXT_ANSWER = re.compile(
    r"(?:answer(?:\s+is)?\s*[:=]?|####|\\boxed\{)\s*\$?\s*(-?[\d,]*\.?\d+)", re.IGNORECASE
)


class ArithEnv(AgentEnv):
    """Arithmetic word problems with a calculator.

    Args:
        split: "train" or "test" (held out).
        max_turns: assistant messages allowed per episode.
        tolerance: absolute error accepted on the answer.
    """

    def __init__(self, split: str = "train", max_turns: int = 6, tolerance: float = 1e-6):
        super().__init__(max_turns=max_turns)
        self.split = split
        self.tasks = load_tasks(split)
        self.tolerance = tolerance
        self.task: ArithTask | None = None

    def task_ids(self) -> Sequence[str]:
        return list(self.tasks)

    def _load_task(self, task_id: str) -> None:
        self.task = self.tasks[task_id]

    def _first_messages(self) -> list[Message]:
        assert self.task is not None
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": self.task.question},
        ]

    def _tools(self) -> Sequence[Tool]:
        return (Tool.from_function(self.calculator), Tool.from_function(self.submit))

    def calculator(self, expression: str) -> str:
        """Evaluates an arithmetic expression.

        Args:
            expression: numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 2".
        """
        try:
            return _format(evaluate(expression))
        except ValueError as error:
            return f"[error] {error}"

    def submit(self, answer: float) -> ToolResult:
        """Submits the final answer and ends the episode.

        Args:
            answer: the final numeric answer.
        """
        correct = self._is_correct(answer)
        return ToolResult("correct" if correct else "incorrect", float(correct), terminated=True)

    def _on_reply(self, content: str) -> Reply:
        found = _TEXT_ANSWER.findall(content)
        if not found:
            return Reply((error_message("call submit, or end your reply with 'Answer: <number>'"),))
        correct = self._is_correct(float(found[-1].replace(",", "")))
        verdict: Message = {"role": "user", "content": "correct" if correct else "incorrect"}
        return Reply((verdict,), float(correct), terminated=True)

    def _is_correct(self, answer: float) -> bool:
        assert self.task is not None
        return math.isfinite(answer) and abs(answer - self.task.answer) <= self.tolerance

    def reference_agent(self) -> ArithReferenceAgent:
        return ArithReferenceAgent(self)

    def _info(self) -> dict[str, Any]:
        return {"split": self.split}


def _format(value: float) -> str:
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)


class ArithReferenceAgent:
    """Scripted reference solver: computes the gold expression with the calculator, then
    submits what the calculator said. It reads the task from the env, as an oracle does."""

    def __init__(self, env: ArithEnv):
        self.env = env

    def act(self, observation: list[Message], info: dict[str, Any]) -> Action:
        task = self.env.task
        assert task is not None
        last = observation[-1]
        if last.get("role") == "tool" and last.get("name") == "calculator":
            return tool_calls_message([("submit", {"answer": float(last["content"])})])
        return tool_calls_message([("calculator", {"expression": task.expression})])
