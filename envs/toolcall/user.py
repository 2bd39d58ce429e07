"""The customer of a tau2-bench episode: a model playing the task's user, or a script.

A user answers the agent's last message given the conversation so far; an answer holding
one of tau2's stop tokens (`###STOP###`, `###TRANSFER###`, `###OUT-OF-SCOPE###`) ends the
episode. A model-driven user plays the task's user as tau2's user simulator does: tau2's
own user guidelines and the task's scenario as its system prompt, the conversation's roles
swapped. `EndpointUser` reaches its model through any OpenAI-compatible endpoint with the
official `openai` client (`user="model"` of `ToolCallEnv`); `ModelUser` through the engine
interface (`generate(messages, ...)`, docs/architecture.md, "Contracts": Engine);
`ScriptedUser` says fixed lines, for tests and reference runs (the default).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

import openai
from openai.types.chat import ChatCompletionMessageParam

from envs.toolcall.taubench import STOP_TOKENS, guidelines

logger = logging.getLogger(__name__)

Message = dict[str, Any]
USERS = ("scripted", "model")


class UserModelError(RuntimeError):
    """The user model could not be reached, or its server answered with an error."""


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


class ModelDrivenUser:
    """A model playing the task's user (see the module docstring); it ends the conversation
    with a stop token of its own, with `###STOP###` when it says nothing, or after
    `max_turns` messages. Subclasses say how the model is reached (`_complete`).

    Args:
        max_turns: the most messages the model writes in an episode, its opening included;
            then the user says `###STOP###` (None: no limit but the env's turn budget).
    """

    GREETING = "Hi! How can I help you today?"
    """What the agent says first in tau2: the user's opening answers it, and the user
    model reads it at the head of every conversation, as tau2's user does."""

    def __init__(self, max_turns: int | None = None):
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"max_turns must be at least 1 or None, got {max_turns}")
        self.max_turns = max_turns
        self._said = 0

    def opening(self, scenario: str) -> str:
        self._said = 0
        return self.reply(scenario, [])

    def reply(self, scenario: str, conversation: Sequence[Message]) -> str:
        if self.max_turns is not None and self._said >= self.max_turns:
            logger.info("the user said its %d messages; it ends the conversation", self._said)
            return STOP_TOKENS[0]
        self._said += 1
        text = self._complete(self.prompt(scenario, conversation)).strip()
        if not text:
            logger.warning("the user model said nothing; the user ends the conversation")
            return STOP_TOKENS[0]
        return text

    def _complete(self, messages: list[Message]) -> str:
        """The model's answer to `messages` (system prompt, then the swapped conversation)."""
        raise NotImplementedError

    @classmethod
    def prompt(cls, scenario: str, conversation: Sequence[Message]) -> list[Message]:
        """What the user model reads, as in tau2: its guidelines and the scenario, then the
        agent's greeting and the conversation, roles swapped (the agent's words as `user`),
        tool traffic left out."""
        system = f"{guidelines()}\n\n<scenario>\n{scenario}\n</scenario>"
        swapped = {"assistant": "user", "user": "assistant"}
        greeting = {"role": "assistant", "content": cls.GREETING}
        turns = [
            {"role": swapped[m["role"]], "content": m["content"]}
            for m in [greeting, *conversation]
            if m.get("role") in swapped and m.get("content")
        ]
        return [{"role": "system", "content": system}, *turns]


class ModelUser(ModelDrivenUser):
    """A model playing the task's user through an engine (the base model by default: the
    user is not the policy being trained).

    Args:
        engine: anything with the engine interface's `generate`.
        adapter: the adapter the user model samples with (None: the base model).
        max_turns: see `ModelDrivenUser`.
    """

    def __init__(
        self,
        engine: GeneratesCompletions,
        adapter: str | None = None,
        max_turns: int | None = None,
    ):
        super().__init__(max_turns)
        self.engine = engine
        self.adapter = adapter

    def _complete(self, messages: list[Message]) -> str:
        completion = self.engine.generate(messages, None, None, self.adapter)
        return str((completion.message or {}).get("content") or "")


class EndpointUser(ModelDrivenUser):
    """A model playing the task's user behind an OpenAI-compatible endpoint (vLLM, SGLang,
    a hosted API), asked with the official `openai` client at tau2's user temperature.

    A failed request (after the client's retries) raises `UserModelError`, naming the
    endpoint; `ToolCallEnv` ends the episode on it.

    Args:
        base_url: the endpoint's base URL, e.g. "http://127.0.0.1:8000/v1".
        model: the model name it serves.
        api_key: its key (None: `$OPENAI_API_KEY`, else a placeholder for keyless servers).
        max_turns: see `ModelDrivenUser`.
        timeout: seconds one request may take.
        temperature: sampling temperature (tau2's user default: 0).
        retries: the client's retries of a request that failed to connect or got a 5xx.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        max_turns: int | None = None,
        timeout: float = 60.0,
        temperature: float = 0.0,
        retries: int = 2,
    ):
        super().__init__(max_turns)
        self.base_url = base_url
        self.model = model
        self.temperature = temperature
        key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.client = openai.OpenAI(
            base_url=base_url, api_key=key, timeout=timeout, max_retries=retries
        )

    def _complete(self, messages: list[Message]) -> str:
        try:
            response = self.client.chat.completions.create(
                model=self.model,
                messages=cast(list[ChatCompletionMessageParam], messages),
                temperature=self.temperature,
            )
        except openai.OpenAIError as error:
            raise UserModelError(
                f"the user model {self.model!r} at {self.base_url} failed: {error}"
            ) from error
        return (response.choices[0].message.content or "") if response.choices else ""


def make_user(
    kind: str,
    base_url: str | None = None,
    model: str | None = None,
    api_key: str | None = None,
    max_turns: int | None = None,
    timeout: float = 60.0,
    temperature: float = 0.0,
) -> TauUser:
    """The user that `ToolCallEnv`'s `user*` kwargs name: "scripted" or "model" (an
    `EndpointUser`); settings that apply to neither are refused, not ignored."""
    if kind not in USERS:
        raise ValueError(f"user must be one of {', '.join(USERS)} (or a TauUser), got {kind!r}")
    if kind == "scripted":
        given = {
            "user_base_url": base_url,
            "user_model": model,
            "user_api_key": api_key,
            "user_max_turns": max_turns,
        }
        stray = [name for name, value in given.items() if value is not None]
        if stray:
            raise ValueError(f"{', '.join(stray)} apply to user='model' only; set user='model'")
        return ScriptedUser()
    if not base_url or not model:
        raise ValueError(
            "user='model' needs user_base_url (an OpenAI-compatible endpoint, e.g. "
            "http://127.0.0.1:8000/v1) and user_model (the model name it serves)"
        )
    return EndpointUser(base_url, model, api_key, max_turns, timeout, temperature)
