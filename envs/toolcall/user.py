"""The customer of a tau2-bench episode: a model playing the task's user, or a script.

A user answers the agent's last message given the conversation so far; an answer holding
one of tau2's stop tokens (`###STOP###`, `###TRANSFER###`, `###OUT-OF-SCOPE###`) ends the
episode. `ModelUser` asks a model, through the engine interface (`generate(messages, ...)`,
DESIGN.md "Engine"), with tau2's own user guidelines and the task's scenario, the
conversation's roles swapped; `ScriptedUser` says fixed lines, for tests and reference runs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from envs.toolcall.taubench import STOP_TOKENS, guidelines

logger = logging.getLogger(__name__)

Message = dict[str, Any]


class TauUser(Protocol):
    """Who the agent talks to in a tau2 episode."""

    def opening(self, scenario: str) -> str:
        """The user's first message, for a task whose user scenario is `scenario`."""
        ...

    def reply(self, scenario: str, conversation: Sequence[Message]) -> str:
        """The user's answer to the conversation's last (assistant) message."""
        ...


class GeneratesCompletions(Protocol):
    """The part of the engine interface a model user needs (agents/engines/base.py)."""

    def generate(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Any = None,
        sampling: Any = None,
        adapter: str | None = ...,
    ) -> Any: ...


def is_stop(text: str) -> bool:
    """Whether a user message ends the conversation, as tau2's user simulator decides."""
    return any(token in text for token in STOP_TOKENS)


class ScriptedUser:
    """A user who says the scenario's reason for calling, then `lines` one by one, then
    `###STOP###`.

    Args:
        lines: the user's replies after the opening, in order.
    """

    def __init__(self, lines: Sequence[str] = ()):
        self.lines = tuple(lines)
        self._said = 0

    def opening(self, scenario: str) -> str:
        self._said = 0
        return scenario

    def reply(self, scenario: str, conversation: Sequence[Message]) -> str:
        if self._said < len(self.lines):
            self._said += 1
            return self.lines[self._said - 1]
        return STOP_TOKENS[0]


class ModelUser:
    """A model playing the task's user through an engine (the base model by default: the
    user is not the policy being trained).

    Args:
        engine: anything with the engine interface's `generate`.
        adapter: the adapter the user model samples with (None: the base model).
    """

    GREETING = "Hi! How can I help you today?"

    def __init__(self, engine: GeneratesCompletions, adapter: str | None = None):
        self.engine = engine
        self.adapter = adapter

    def opening(self, scenario: str) -> str:
        return self.reply(scenario, [{"role": "assistant", "content": self.GREETING}])

    def reply(self, scenario: str, conversation: Sequence[Message]) -> str:
        completion = self.engine.generate(
            self.prompt(scenario, conversation), None, None, self.adapter
        )
        text = str((completion.message or {}).get("content") or "").strip()
        if not text:
            logger.warning("the user model said nothing; the user ends the conversation")
            return STOP_TOKENS[0]
        return text

    @staticmethod
    def prompt(scenario: str, conversation: Sequence[Message]) -> list[Message]:
        """What the user model reads: tau2's guidelines and the scenario, then the
        conversation with roles swapped (the agent's words as `user`), tool traffic left out."""
        system = f"{guidelines()}\n\n<scenario>\n{scenario}\n</scenario>"
        swapped = {"assistant": "user", "user": "assistant"}
        turns = [
            {"role": swapped[m["role"]], "content": m["content"]}
            for m in conversation
            if m.get("role") in swapped and m.get("content")
        ]
        return [{"role": "system", "content": system}, *turns]
