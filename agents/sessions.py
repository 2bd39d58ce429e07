"""Sessions as the proxy sees them: who is talking, which turn this is, what came next.

`identify` reads a request's session identity. Headers first (`X-Session-Id`,
`X-Turn-Type`, `X-Session-Done`), then OpenClaw's own session headers (`session_id`,
`x-session-affinity`, both `<id>:0`), then body fields of the same names (`session_id`,
`turn_type`, `session_done`), which are removed from the body before anything else sees
it. No session id: a fresh one. No turn type: the configured default (`main`), so a
client that sends no headers still trains, unlike OpenClaw-RL's proxy.

`SessionTracker` keeps the store in step: it opens the session on first sight, reserves
turn indexes, commits each turn token-exactly, and when the next main request of a
session arrives, fills the previous main turn's next state with what that request adds
after the previous assistant reply: the user's answer, tool results. It finds that reply in
the new history (where it is expected, else by content) instead of taking the last message,
and leaves out OpenClaw's transient internal-context message, which every request carries
and no history keeps. State lives in memory and is rebuilt from the store for a session it
has not seen (a restarted proxy continues a session).

Side turns (memory flushes, heartbeats, and every request to the base model) are recorded
as `side` turns without a next state: served and kept for analysis, never trained.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import uuid
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from agents.engines.base import Completion
from agents.store import Store
from agents.trajectory import Session, Turn, TurnType

logger = logging.getLogger(__name__)

INTERNAL_CONTEXT = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"
_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class SessionInfo:
    """A request's place in a conversation."""

    session_id: str
    turn_type: TurnType
    done: bool
    """The client closes the session with this request."""


def identify(
    headers: Mapping[str, str], body: MutableMapping[str, Any], default: TurnType
) -> SessionInfo:
    """The session of a request; pops the body fallbacks so the engine never sees them."""
    fields = {name: body.pop(name, None) for name in ("session_id", "turn_type", "session_done")}
    session_id = (
        headers.get("x-session-id")
        or _affinity(headers.get("session_id") or headers.get("x-session-affinity"))
        or fields["session_id"]
    )
    kind = headers.get("x-turn-type") or fields["turn_type"] or default
    done = headers.get("x-session-done") or fields["session_done"]
    if str(kind).lower() not in ("main", "side"):
        raise ValueError(f"turn type must be 'main' or 'side', got {kind!r}")
    return SessionInfo(
        session_id=str(session_id) if session_id else uuid.uuid4().hex,
        turn_type=TurnType(str(kind).lower()),
        done=str(done).lower() in _TRUE if done is not None else False,
    )


def _affinity(value: str | None) -> str | None:
    """OpenClaw's `<sessionId>:0` to the session id."""
    if not value:
        return None
    head, sep, tail = value.rpartition(":")
    return head if sep and tail.isdigit() and head else value


def is_transient(message: Mapping[str, Any]) -> bool:
    """OpenClaw's per-request internal-context message, which no history keeps."""
    return message.get("role") == "user" and _text(message.get("content")).lstrip().startswith(
        INTERNAL_CONTEXT
    )


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)


def _same_reply(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two assistant messages say the same (clients may re-shape them)."""
    return _text(a.get("content")).strip() == _text(b.get("content")).strip() and _calls(
        a
    ) == _calls(b)


def _calls(message: Mapping[str, Any]) -> list[tuple[str, Any]]:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        arguments = function.get("arguments")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass
        calls.append((function.get("name"), arguments))
    return calls


def next_state(
    messages: Sequence[Mapping[str, Any]],
    prompt_length: int,
    replies: Sequence[Mapping[str, Any]],
) -> tuple[int, list[Mapping[str, Any]]] | None:
    """Which previous reply the new history continues, and what it adds after it.

    Args:
        messages: the new request's messages, transient ones removed.
        prompt_length: how many (non-transient) messages the previous request had.
        replies: the previous turn's replies (several when it had n > 1 choices).
    """
    expected = messages[prompt_length] if len(messages) > prompt_length else None
    if expected is not None and expected.get("role") == "assistant":
        position = prompt_length
    else:
        assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        matching = [i for i in assistants if any(_same_reply(messages[i], r) for r in replies)]
        position = (matching or assistants or [-1])[-1]
    if position < 0 or position + 1 >= len(messages):
        return None
    choice = next((i for i, r in enumerate(replies) if _same_reply(messages[position], r)), 0)
    return choice, list(messages[position + 1 :])


@dataclass(frozen=True)
class _LastMain:
    indexes: tuple[int, ...]
    prompt_length: int
    replies: tuple[Mapping[str, Any], ...]


@dataclass
class _State:
    next_index: int = 0
    last: _LastMain | None = None


class SessionTracker:
    """The proxy's sessions, turn indexes and next-state links, kept in the store.

    Args:
        store: where sessions and turns are committed.
        env_id: the `env_id` of sessions the proxy opens.
    """

    def __init__(self, store: Store, env_id: str = "live"):
        self.store, self.env_id = store, env_id
        self._lock = threading.Lock()
        self._states: dict[str, _State] = {}

    def begin(self, info: SessionInfo, messages: Sequence[Mapping[str, Any]], count: int) -> int:
        """Registers a request of `count` choices: links the previous main turn to its next
        state (main requests only) and returns the first of the indexes it reserves."""
        state = self._state(info.session_id)
        link = None
        with self._lock:
            first, state.next_index = state.next_index, state.next_index + count
            if info.turn_type is TurnType.MAIN and state.last is not None:
                kept = [m for m in messages if not is_transient(m)]
                found = next_state(kept, state.last.prompt_length, state.last.replies)
                if found is not None:
                    link = (state.last.indexes[found[0]], found[1])
                    state.last = None
        if link is not None:
            self.store.set_next_state(info.session_id, link[0], link[1])
        return first

    def commit(
        self,
        info: SessionInfo,
        first: int,
        messages: Sequence[Mapping[str, Any]],
        completions: Sequence[Completion],
        replies: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        """Commits the request's turns; closes the session if the client said so."""
        for offset, (completion, reply) in enumerate(zip(completions, replies, strict=True)):
            self.store.add_turn(_turn(info, first + offset, messages, completion, reply, tools))
        if info.turn_type is TurnType.MAIN:
            prompt_length = sum(1 for m in messages if not is_transient(m))
            indexes = tuple(range(first, first + len(completions)))
            state = self._state(info.session_id)
            with self._lock:
                state.last = _LastMain(indexes, prompt_length, tuple(replies))
        if info.done:
            self.close(info.session_id)

    def close(self, session_id: str) -> None:
        """Marks the session done; its state is forgotten."""
        with self._lock:
            self._states.pop(session_id, None)
        self.store.finish_session(session_id)

    def _state(self, session_id: str) -> _State:
        with self._lock:
            state = self._states.get(session_id)
        if state is not None:
            return state
        state = self._open(session_id)
        with self._lock:
            return self._states.setdefault(session_id, state)

    def _open(self, session_id: str) -> _State:
        """A new session in the store, or the state of one it already holds."""
        try:
            self.store.add_session(Session(session_id, self.env_id))
            return _State()
        except sqlite3.IntegrityError:
            pass
        turns = self.store.session(session_id).turns
        state = _State(next_index=max((t.index for t in turns), default=-1) + 1)
        mains = [t for t in turns if t.turn_type is TurnType.MAIN]
        if mains and mains[-1].next_state is None:
            last = mains[-1]
            length = sum(1 for m in last.prompt_messages if not is_transient(m))
            state.last = _LastMain((last.index,), length, (last.completion,))
        logger.info("continuing session %s at turn %d", session_id, state.next_index)
        return state


def _turn(
    info: SessionInfo,
    index: int,
    messages: Sequence[Mapping[str, Any]],
    completion: Completion,
    reply: Mapping[str, Any],
    tools: Sequence[Mapping[str, Any]],
) -> Turn:
    return Turn(
        session_id=info.session_id,
        index=index,
        turn_type=info.turn_type,
        prompt_messages=tuple(messages),
        prompt_token_ids=completion.prompt_token_ids,
        completion_token_ids=completion.completion_token_ids,
        completion_logprobs=completion.completion_logprobs,
        completion=reply,
        policy_version=completion.policy_version,
        tools=tuple(tools),
    )
