"""Sessions as the proxy records them: which turn this is, and what came next. A request's
session identity is read by `agents.serving.identity`; whether a history continues a reply
is decided by `agents.serving.histories`.

No session id: the proxy mints one, and returns it in the `X-Session-Id` response header,
unless the request continues a conversation the proxy served without an id: a request
whose last assistant message, with everything before it, is exactly a previous reply of
such a session and that reply's prompt, is that session's next turn. So a plain OpenAI
client that sends its history back trains on linked turns without knowing about sessions.

`SessionTracker` keeps the store in step. It opens a session on first sight, commits each
turn token-exactly with the next free index, and keeps the session's *open ends*: its main
turns still waiting for what the conversation says after them. When a main request of the
session arrives, the open end whose reply the new history contains (where it is expected,
else anywhere: a client may compact its history) gets what the history adds after that
reply as its next state: the user's answer, tool results; OpenClaw's transient
internal-context message, which every request carries and no history keeps, is left out.
A request that contains no open end's reply (an auxiliary call sent as `main`, a history
the client edited) links nothing: the policy's reply is never judged against a reaction to
something else. The linked turn's siblings (the other choices of an n > 1 request, a retry
of the same prompt) can never be continued any more: their next state is set empty, which
the judges read as "the conversation did not go on from here" (judged empty, masked).

Open ends that nothing continues (the last turn of a session the client never closes, an
auxiliary call) end empty the same way once their session has been idle for
`expire_idle`'s limit, and the session's in-memory state is dropped, so a long-running
proxy holds only its active sessions. A session the client closed with `X-Session-Done` is
final: a later request naming it is refused (`SessionEnded`). State is rebuilt from the
store for a session not in memory (a restarted proxy, a user back after a pause).

Sessions are scoped by credential (`agents.serving.identity`): a request reaches only the
sessions of its own credential, by id or by its history, and only the client that opened a
session may close it.

Side turns (memory flushes, heartbeats, and every request to the base model) are recorded
as `side` turns without a next state: served and kept for analysis, never trained.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from agents.engines.base import Completion
from agents.serving.histories import OpenEnd, continued, conversation_key, is_transient
from agents.serving.identity import (
    OWNER,
    SessionEnded,
    SessionInfo,
    SessionNotOwned,
    SessionRefused,
    client_id,
    owned_by,
    owner_tag,
)
from agents.store import Store
from agents.trajectory import Session, SessionStatus, TurnType, sampled_turn

logger = logging.getLogger(__name__)

MAX_OPEN_ENDS = 64
"""Most turns of one session waiting for a next state; older ones are ended empty."""


@dataclass
class _State:
    next_index: int = 0
    named: bool = True
    open_ends: list[OpenEnd] = field(default_factory=list)
    seen: float = field(default_factory=time.monotonic)
    owner: str | None = None
    """`owner_tag` of the client that opened the session; None: its admin route ends it."""
    scope: str = ""
    """The scope of the session's credential (`SessionInfo.scope`)."""


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
        self._unnamed: dict[tuple[str, int], list[str]] = {}
        """Scope and `conversation_key` of an open end's prompt + reply -> the minted-id
        sessions (stored ids) of that scope waiting there."""
        self._ended: list[tuple[str, int]] = []
        """Open ends dropped for `MAX_OPEN_ENDS`, still to be ended in the store."""

    def begin(self, info: SessionInfo, messages: Sequence[Mapping[str, Any]]) -> SessionInfo:
        """Registers a request before it is served: recognises the conversation of a request
        without a session id, links the open end it continues (main requests), and returns
        the request's session.

        Raises:
            SessionEnded: the session was closed by its client.
            SessionNotOwned: the request would close a session another client opened.
        """
        kept: list[Mapping[str, Any]] = []
        if info.turn_type is TurnType.MAIN:
            kept = [m for m in messages if not is_transient(m)]
            if not info.named and (continued := self._recognise(info.scope, kept)) is not None:
                info = replace(info, session_id=client_id(info.scope, continued))
        state = self._state(info, refuse_ended=True)
        if info.done and not _owns(state.owner, info):
            raise SessionNotOwned(
                f"the session {info.session_id!r} was opened by an episode's client: its "
                "admin route ends it"
            )
        with self._lock:
            state.seen = time.monotonic()
            links = self._links(info.stored_id, state, kept) if kept and state.open_ends else []
        for index, added in links:
            self.store.set_next_state(info.stored_id, index, added)
        return info

    def _recognise(self, scope: str, kept: Sequence[Mapping[str, Any]]) -> str | None:
        """The minted-id session of `scope` whose open end the history continues from its
        last assistant message, if any (its stored id)."""
        last = next(
            (i for i in range(len(kept) - 1, -1, -1) if kept[i].get("role") == "assistant"), -1
        )
        if last < 0 or last + 1 == len(kept):
            return None
        with self._lock:
            waiting = self._unnamed.get((scope, conversation_key(kept[: last + 1])))
            return waiting[-1] if waiting else None

    def _links(
        self, session_id: str, state: _State, kept: Sequence[Mapping[str, Any]]
    ) -> list[tuple[int, list[Mapping[str, Any]]]]:
        """The next states a main request gives (under the lock): its open end's, and empty
        ones for that end's siblings."""
        found = continued(state.open_ends, kept)
        if found is None:
            return []
        end, added = found
        siblings = [e for e in state.open_ends if e is not end and e.prompt == end.prompt]
        closed = [end, *siblings]
        state.open_ends = [e for e in state.open_ends if e not in closed]
        self._forget_keys(session_id, state.scope, closed)
        return [(end.index, added), *((e.index, []) for e in siblings)]

    def open(self, session: Session) -> None:
        """Opens a session its client describes before its first request (a simulated
        episode names its env, task and group).

        Raises:
            SessionRefused: the id is taken.
        """
        try:
            self.store.add_session(session)
        except sqlite3.IntegrityError as error:
            raise SessionRefused(
                f"the session {session.session_id!r} exists already; use a new id", "session_id"
            ) from error
        with self._lock:
            self._states.setdefault(session.session_id, _State())

    def end(
        self,
        session_id: str,
        messages: Sequence[Mapping[str, Any]],
        rewards: Mapping[int, float],
        outcome_reward: float | None,
        status: SessionStatus = SessionStatus.DONE,
        reason: str | None = None,
    ) -> None:
        """Ends an episode: the final history gives the turn it continues its next state
        (the environment's last observation), the session's other open ends end empty,
        each turn gets its environment reward, and the session its outcome, status and the
        reason it ended (`Store.finish_session`).

        Raises:
            KeyError: no such session.
            SessionEnded: the session was ended already.
        """
        self.store.session_status(session_id)  # a KeyError for an unknown id
        state = self._state(SessionInfo(session_id, TurnType.MAIN, False), refuse_ended=True)
        kept = [m for m in messages if not is_transient(m)]
        with self._lock:
            links = self._links(session_id, state, kept) if kept and state.open_ends else []
            rest, state.open_ends = state.open_ends, []
            self._forget_keys(session_id, state.scope, rest)
            self._states.pop(session_id, None)
        for index, added in links:
            self.store.set_next_state(session_id, index, added)
        self.store.end_turns((session_id, end.index) for end in rest)
        self.store.set_env_rewards(session_id, rewards)
        self.store.finish_session(session_id, outcome_reward, status, reason)

    def commit(
        self,
        info: SessionInfo,
        messages: Sequence[Mapping[str, Any]],
        completions: Sequence[Completion],
        replies: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> int:
        """Commits the request's turns at the session's next indexes (returns the first);
        closes the session if the client said so."""
        state, stored = self._state(info), info.stored_id
        with self._lock:
            first, state.next_index = state.next_index, state.next_index + len(completions)
            state.seen = time.monotonic()
        for offset, (completion, reply) in enumerate(zip(completions, replies, strict=True)):
            turn = sampled_turn(
                stored, first + offset, info.turn_type, messages, completion, reply, tools
            )
            self.store.add_turn(turn)
        if info.done:
            self.close(stored)
            return first
        if info.turn_type is TurnType.MAIN:
            prompt = tuple(m for m in messages if not is_transient(m))
            ends = [
                OpenEnd(
                    first + offset,
                    prompt,
                    reply,
                    None if state.named else conversation_key((*prompt, reply)),
                )
                for offset, reply in enumerate(replies)
            ]
            with self._lock:
                state.open_ends.extend(ends)
                for end in ends:
                    if end.key is not None:
                        self._unnamed.setdefault((state.scope, end.key), []).append(stored)
                # a client that never answers: bounded memory and search; the store hears
                # of it with the next `expire_idle`, off the request's path
                stale = state.open_ends[:-MAX_OPEN_ENDS]
                del state.open_ends[:-MAX_OPEN_ENDS]
                self._forget_keys(stored, state.scope, stale)
                self._ended.extend((stored, end.index) for end in stale)
        return first

    def close(self, session_id: str) -> None:
        """Marks the session done; its state is forgotten."""
        with self._lock:
            state = self._states.pop(session_id, None)
            if state is not None:
                self._forget_keys(session_id, state.scope, state.open_ends)
        self.store.finish_session(session_id)

    def expire_idle(self, idle_s: float) -> int:
        """Ends every open end of the sessions idle for `idle_s` seconds (their next state
        is set empty: nothing continued them), and those dropped for `MAX_OPEN_ENDS`, and
        forgets the idle sessions; returns how many turns it ended."""
        now = time.monotonic()
        with self._lock:
            idle = [(i, s) for i, s in self._states.items() if now - s.seen >= idle_s]
            for session_id, state in idle:
                del self._states[session_id]
                self._forget_keys(session_id, state.scope, state.open_ends)
            ended = [(i, end.index) for i, state in idle for end in state.open_ends]
            ended, self._ended = ended + self._ended, []
        if ended:
            self.store.end_turns(ended)
        return len(ended)

    def _forget_keys(self, session_id: str, scope: str, ends: Sequence[OpenEnd]) -> None:
        """Drops ended open ends from the index of minted-id sessions (under the lock)."""
        for end in ends:
            key = (scope, end.key) if end.key is not None else None
            waiting = self._unnamed.get(key) if key is not None else None
            if waiting and session_id in waiting:
                waiting.remove(session_id)
                if not waiting:
                    del self._unnamed[key]  # type: ignore[arg-type]

    def _state(self, info: SessionInfo, refuse_ended: bool = False) -> _State:
        with self._lock:
            state = self._states.get(info.stored_id)
        if state is not None:
            return state
        state = self._open(info, refuse_ended)
        with self._lock:
            return self._states.setdefault(info.stored_id, state)

    def _open(self, info: SessionInfo, refuse_ended: bool) -> _State:
        """A new session in the store, or the state of one it already holds."""
        session_id, owner = info.stored_id, owner_tag(info.scope.encode())
        try:
            self.store.add_session(Session(session_id, self.env_id, metadata={OWNER: owner}))
            return _State(named=info.named, owner=owner, scope=info.scope)
        except sqlite3.IntegrityError:
            pass
        session = self.store.session(session_id)
        if refuse_ended and session.status is not SessionStatus.OPEN:
            raise SessionEnded(f"the session {info.session_id!r} is {session.status}; use a new id")
        state = _State(
            next_index=max((t.index for t in session.turns), default=-1) + 1,
            owner=session.metadata.get(OWNER),
            scope=info.scope,
        )
        state.open_ends = [
            OpenEnd(
                t.index, tuple(m for m in t.prompt_messages if not is_transient(m)), t.completion
            )
            for t in session.turns
            if t.turn_type is TurnType.MAIN and t.next_state is None
        ]
        logger.info("continuing session %s at turn %d", session_id, state.next_index)
        return state


def _owns(owner: str | None, info: SessionInfo) -> bool:
    """Whether the request's client opened the session: its scope is kept (all clients of a
    scope are one), or, in a store written before scopes, its credential."""
    return owned_by(owner, info.scope.encode()) or owned_by(owner, info.credential)
