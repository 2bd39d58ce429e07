"""Experience notes for on-policy context distillation (`method=oel`).

After a session ends, the model writes "experience" from the whole conversation: short rules
(what the user prefers, what they corrected). A frozen teacher, the base model with the
adapter off and those notes in its system prompt, then scores every turn of the session,
and the student learns reverse KL to it over the teacher's top-k plus a tail bin
(`trainers.distillation.tail_bin_reverse_kl`, in the learner's loss: `trainers.topk`): what
the notes say moves from the prompt into the weights.

A session has ended when it is closed (an env's episode finished, a live client's
`X-Session-Done`) or, for a live client that never closes, when every main turn of it has
its next state (the proxy ends a turn nothing continued once the session idles). The notes
are kept in the session's metadata (`experience`, with `experience_turns`, the main turns
they cover); a live user who comes back after the notes were written gets them rewritten
over the longer conversation for the turns that follow.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from agents.engines.base import POLICY, Engine, SamplingParams
from agents.store import Store
from agents.trajectory import Message, Session, SessionStatus, Turn, TurnType
from trainers.judge import fill, load_template, render_next_state

logger = logging.getLogger(__name__)

EXPERIENCE_HEADER = "[experience from earlier conversations]\n"
"""What precedes the notes in the teacher's system prompt."""
NOTES_KEY, COVERS_KEY = "experience", "experience_turns"
"""The session metadata keys of the notes and of the main turns they cover."""


def with_experience(messages: Sequence[Message], notes: str) -> list[dict[str, Any]]:
    """The teacher's context: the notes appended to the system message (one is added
    first when the conversation has none)."""
    copied = [dict(m) for m in messages]
    block = EXPERIENCE_HEADER + notes
    if copied and copied[0].get("role") == "system":
        copied[0]["content"] = f"{_text(copied[0].get('content'))}\n\n{block}"
        return copied
    return [{"role": "system", "content": block}, *copied]


def transcript(turns: Sequence[Turn]) -> str:
    """The whole conversation of a session's main turns as `role: text` lines: the last
    turn's prompt (its history holds the earlier turns), its reply and what followed."""
    if not turns:
        return ""
    last = turns[-1]
    messages = [*last.prompt_messages, last.completion]
    lines = [f"{m.get('role', 'user')}: {_text(m.get('content'))}" for m in messages]
    if last.next_state:
        role, text = render_next_state(last.next_state)
        lines.append(f"{role}: {text}")
    return "\n".join(lines)


def has_ended(session: Session, turns: Sequence[Turn]) -> bool:
    """Whether a session's conversation is over for now (see the module docstring)."""
    if session.status != SessionStatus.OPEN:
        return True
    return bool(turns) and all(t.next_state is not None for t in turns)


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


class ExperienceWriter:
    """Writes and keeps each ended session's experience notes.

    Args:
        engine: the policy's engine; the model being trained writes its own notes.
        store: where sessions and their notes are.
        template: the prompt, a file path or a name in trainers/prompts/ (`{conversation}`).
        max_tokens: the most tokens the notes take.
        temperature: their sampling temperature.
    """

    def __init__(
        self, engine: Engine, store: Store, template: str, max_tokens: int, temperature: float
    ):
        self.engine, self.store = engine, store
        self.template = load_template(template)
        self.sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens)

    def notes(self, session_id: str) -> str | None:
        """The session's notes, written now if it has ended since they last were; None
        while it goes on."""
        session = self.store.session(session_id)
        turns = [t for t in session.turns if t.turn_type == TurnType.MAIN]
        if not has_ended(session, turns):
            return None
        if session.metadata.get(COVERS_KEY) == len(turns):
            return str(session.metadata.get(NOTES_KEY, ""))
        prompt = fill(self.template, {"conversation": transcript(turns)})
        completion = self.engine.generate(
            [{"role": "user", "content": prompt}], None, self.sampling, POLICY
        )
        notes = _text(completion.message.get("content")).strip()
        self.store.update_session_metadata(session_id, {NOTES_KEY: notes, COVERS_KEY: len(turns)})
        logger.debug("experience of session %s: %d characters", session_id, len(notes))
        return notes
