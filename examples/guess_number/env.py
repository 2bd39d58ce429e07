"""Guess the number: the smallest multi-turn env, written as a user of clawgym writes one.

The agent is told that a secret whole number lies in a range and finds it with the `guess`
tool, which answers "higher", "lower" or "correct". Finding it earns 1 and ends the
episode; running out of turns ends it truncated with 0. Each turn depends on what the env
said to the turn before, which is what makes it an agentic task rather than a single reply:
bisecting the range finds any of 100 numbers in 7 guesses.

Everything else (parsing the policy's tool calls, errors for malformed calls, the turn
budget, `terminated` apart from `truncated`) is `AgentEnv`'s.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from envs.core import Action, AgentEnv, Message, ToolResult, tool_calls_message
from envs.tools import Tool

SPLIT_SIZES = {"train": 200, "test": 50}


def secret_numbers(split: str, low: int, high: int) -> dict[str, int]:
    """Task id -> secret number, the same for a given split and range on every machine.

    The held-out split draws from other seeds; with only `high - low + 1` numbers its
    secrets repeat the training ones, so what transfers is a strategy, not answers.
    """
    if split not in SPLIT_SIZES:
        raise ValueError(f"split must be one of {sorted(SPLIT_SIZES)}, got {split!r}")
    if low >= high:
        raise ValueError(f"the range needs low < high, got {low}..{high}")
    return {
        f"{split}-{index}": random.Random(f"{split}-{index}").randint(low, high)
        for index in range(SPLIT_SIZES[split])
    }


class GuessNumberEnv(AgentEnv):
    """Find a secret number by asking higher or lower.

    Args:
        split: "train" or "test" (held out).
        low: the smallest number the secret can be.
        high: the largest number the secret can be.
        max_turns: assistant messages allowed per episode.
    """

    def __init__(self, split: str = "train", low: int = 1, high: int = 100, max_turns: int = 8):
        super().__init__(max_turns=max_turns)
        self.split, self.low, self.high = split, low, high
        self.secrets = secret_numbers(split, low, high)
        self.secret: int | None = None

    def task_ids(self) -> Sequence[str]:
        return list(self.secrets)

    def _load_task(self, task_id: str) -> None:
        self.secret = self.secrets[task_id]

    def _first_messages(self) -> list[Message]:
        return [
            {
                "role": "system",
                "content": "Find the secret number. Call guess with one whole number at a "
                "time; it answers higher, lower or correct.",
            },
            {
                "role": "user",
                "content": f"The secret is a whole number from {self.low} to {self.high}. "
                f"You have {self.max_turns} guesses.",
            },
        ]

    def _tools(self) -> Sequence[Tool]:
        return (Tool.from_function(self.guess),)

    def guess(self, number: int) -> str | ToolResult:
        """Guesses the secret number.

        Args:
            number: a whole number in the range.
        """
        assert self.secret is not None, "reset before step"
        if not self.low <= number <= self.high:
            return f"[error] {number} is outside {self.low}..{self.high}"
        if number < self.secret:
            return "higher"
        if number > self.secret:
            return "lower"
        return ToolResult("correct", reward=1.0, terminated=True)

    def reference_agent(self) -> BisectingAgent:
        return BisectingAgent(self.low, self.high)

    def _info(self) -> dict[str, Any]:
        return {"split": self.split}


class BisectingAgent:
    """The reference solver: guesses the middle of what is left. Unlike an oracle it never
    reads the secret, only the env's answers, so its demonstrations teach a strategy."""

    def __init__(self, low: int, high: int):
        self.low, self.high = low, high
        self.last: int | None = None

    def act(self, observation: list[Message], info: dict[str, Any]) -> Action:
        answer = observation[-1].get("content") if observation else None
        if self.last is not None and answer == "higher":
            self.low = self.last + 1
        elif self.last is not None and answer == "lower":
            self.high = self.last - 1
        self.last = (self.low + self.high) // 2
        return tool_calls_message([("guess", {"number": self.last})])
