"""The simulated user of `clawgym/Chat-v0`: decides how to react, then says it.

The decision is scripted: a reply meeting the persona's preference and about the question
satisfies the user, who thanks the assistant and moves on (next question, or "that's all");
a reply missing the preference draws a correction naming it and a request to redo; an
empty reply, or one that meets the preference about nothing, draws the question again;
after `patience` tries at one question the user gives up on it. So a judge reading the
user's next message, as OpenClaw-RL's does, sees +1 or -1 plainly.

The wording is drawn from varied phrasings with the env's generator (deterministic under
its seed). An optional `user_model(messages) -> str` (an LLM playing the user) may
rephrase it: it receives a system prompt giving the persona, the decision and the
scripted draft, then the conversation with roles swapped (the assistant's replies as
`user`, the simulated user's messages as `assistant`). A blank answer keeps the draft.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from envs.chat.personas import Persona

logger = logging.getLogger(__name__)

Message = dict[str, Any]
UserModel = Callable[[list[Message]], str]


class Verdict(enum.StrEnum):
    """How the user takes the assistant's last reply."""

    SATISFIED = "satisfied"
    """The preference is met: thanks, and the next question or goodbye."""
    CORRECTION = "correction"
    """An answer that misses the preference: a complaint and a request to redo."""
    REDO = "redo"
    """No answer to the question (an empty reply, or one about something else that meets
    the preference): the question again."""
    GAVE_UP = "gave_up"
    """Still wrong after `patience` corrections: the user drops the question."""


GREETINGS = ("", "", "Hi! ", "Hey, quick question. ", "Hello. ", "Hi there. ")
THANKS = (
    "Thanks, that's exactly what I needed.",
    "Perfect, thank you.",
    "Great, thanks.",
    "That's helpful, thanks.",
    "Nice, that works for me. Thanks!",
    "Got it, thanks.",
)
NEXT = (
    "Next question: {q}",
    "Another one: {q}",
    "Okay, next. {q}",
    "{q}",
    "Moving on. {q}",
    "One more thing: {q}",
)
GOODBYES = (
    "Thanks, that's all for now.",
    "Perfect, that's everything I needed. Thanks!",
    "Great, thank you. That's it for today.",
    "Thanks, I'm all set.",
)
RETRY = ("Try again.", "Can you redo that?", "Please redo it.", "Once more, please.", "")
STILL = "Still not right. "
REDO = (
    "You didn't answer my question. {q}",
    "Hello? I asked: {q}",
    "That's not an answer. Please try again: {q}",
)
GAVE_UP = (
    "Forget it, that's still not what I asked for.",
    "Never mind, you're not listening.",
    "Let's drop it; that's still not how I want it.",
)
NEXT_AFTER_GIVING_UP = ("Next question: {q}", "Something else then: {q}")
LAST_AFTER_GIVING_UP = ("I'll look it up myself.", "That's all for today.")

INTENTS = {
    Verdict.SATISFIED: "The assistant's last reply was what you wanted: thank it and move on.",
    Verdict.CORRECTION: "The assistant's last reply missed your preference: complain, say "
    "what you want instead, and ask it to redo the answer.",
    Verdict.REDO: "The assistant did not answer: ask your question again.",
    Verdict.GAVE_UP: "The assistant missed your preference again: give up on this question.",
}


class SimulatedUser:
    """One persona's side of the conversation.

    Args:
        persona: who is talking.
        rng: the env's generator (`self.np_random`), for the choice of words.
        user_model: optional LLM user that rephrases the scripted draft.
    """

    def __init__(self, persona: Persona, rng: np.random.Generator, user_model: UserModel | None):
        self.persona = persona
        self.rng = rng
        self.user_model = user_model

    def ask(self, question: str) -> str:
        """The message that opens the conversation."""
        return self._pick(GREETINGS) + question

    def react(
        self, verdict: Verdict, question: str, next_question: str | None, attempt: int
    ) -> str:
        """The scripted words for a verdict on the reply to `question` (`attempt` from 1)."""
        if verdict is Verdict.SATISFIED:
            if next_question is None:
                return self._pick(GOODBYES)
            return f"{self._pick(THANKS)} {self._pick(NEXT).format(q=next_question)}"
        if verdict is Verdict.REDO:
            return self._pick(REDO).format(q=question)
        if verdict is Verdict.GAVE_UP:
            after = (
                self._pick(NEXT_AFTER_GIVING_UP).format(q=next_question)
                if next_question
                else self._pick(LAST_AFTER_GIVING_UP)
            )
            return f"{self._pick(GAVE_UP)} {after}"
        complaint = (STILL if attempt > 1 else "") + self._pick(self.persona.complaints)
        return f"{complaint} {self._pick(RETRY)}".strip()

    def say(self, verdict: Verdict, draft: str, conversation: Sequence[Message]) -> str:
        """The draft, or the user model's rephrasing of it when there is one."""
        if self.user_model is None:
            return draft
        text = self.user_model(self.prompt(verdict, draft, conversation))
        if not isinstance(text, str) or not text.strip():
            logger.warning("user_model gave no text; keeping the scripted reply")
            return draft
        return text.strip()

    def prompt(
        self, verdict: Verdict, draft: str, conversation: Sequence[Message]
    ) -> list[Message]:
        """What the user model reads: its brief, then the conversation with roles swapped."""
        brief = (
            f"You are {self.persona.name}, a person chatting with your AI assistant. You "
            f"{self.persona.preference}. {INTENTS[verdict]} Write only your next message, "
            f"one to three sentences, in your own words but close to this, keeping any "
            f'question in it word for word: "{draft}"'
        )
        swapped = {"user": "assistant", "assistant": "user"}
        turns = [
            {"role": swapped[m["role"]], "content": m.get("content") or ""}
            for m in conversation
            if m.get("role") in swapped
        ]
        return [{"role": "system", "content": brief}, *turns]

    def _pick(self, options: Sequence[str]) -> str:
        return options[int(self.rng.integers(len(options)))]
