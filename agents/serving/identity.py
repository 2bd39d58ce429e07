"""A request's session identity: which session it belongs to, its turn type, whether it
closes the session, and who is asking.

`identify` reads a request's session identity. Headers first (`X-Session-Id`,
`X-Turn-Type`, `X-Session-Done`), then OpenClaw's own session headers (`session_id`,
`x-session-affinity`, both `<id>:0`), then body fields of the same names (`session_id`,
`turn_type`, `session_done`), which are removed from the body before anything else sees
it. A session id is 1-256 printable ASCII characters (it goes back in a response header).
No turn type: the configured default (`main`), so a client that sends no headers still
trains, unlike OpenClaw-RL's proxy.

Only the client that opened a session may close it: a session belongs to the credential
(the `Authorization` header) of the request that opened it, kept in its metadata as a
salted hash (`OWNER`), so that it outlives the in-memory state; `X-Session-Done` from any
other credential is refused (`SessionNotOwned`). Clients that share a key are one client
to the proxy, and so are clients that send none. A session an episode's client opened
(`agents.serving.sessions.SessionTracker.open`, the proxy's admin route) has no owner: its
admin route ends it.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import uuid
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from agents.trajectory import TurnType

MAX_SESSION_ID = 256
_TRUE = {"1", "true", "yes", "on"}
OWNER = "owner"
"""The session metadata key of its owner's credential, salted and hashed (`owner_tag`)."""


class SessionRefused(ValueError):
    """A request whose session fields are invalid (`param` names the offending one)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class SessionEnded(Exception):
    """A request names a session its client already closed with `X-Session-Done`."""


class SessionNotOwned(Exception):
    """A request would close a session another client opened."""


@dataclass(frozen=True)
class SessionInfo:
    """A request's place in a conversation."""

    session_id: str
    turn_type: TurnType
    done: bool
    """The client closes the session with this request."""
    named: bool = True
    """The client named the session; False: the proxy minted the id."""
    credential: str = field(default="", repr=False)
    """The request's `Authorization` header: who is asking (`owner_tag`)."""


def identify(
    headers: Mapping[str, str], body: MutableMapping[str, Any], default: TurnType
) -> SessionInfo:
    """The session of a request; pops the body fallbacks so the engine never sees them.

    Raises:
        SessionRefused: a session id or turn type the proxy cannot take.
    """
    fields = {name: body.pop(name, None) for name in ("session_id", "turn_type", "session_done")}
    session_id = (
        headers.get("x-session-id")
        or _affinity(headers.get("session_id") or headers.get("x-session-affinity"))
        or fields["session_id"]
    )
    kind = headers.get("x-turn-type") or fields["turn_type"] or default
    done = headers.get("x-session-done") or fields["session_done"]
    if str(kind).lower() not in ("main", "side"):
        raise SessionRefused(f"turn type must be 'main' or 'side', got {kind!r}", "X-Turn-Type")
    return SessionInfo(
        session_id=checked_id(session_id) if session_id else uuid.uuid4().hex,
        turn_type=TurnType(str(kind).lower()),
        done=str(done).lower() in _TRUE if done is not None else False,
        named=bool(session_id),
        credential=headers.get("authorization", ""),
    )


def owner_tag(credential: str, salt: bytes | None = None) -> str:
    """`salt:sha256(salt + credential)`, hex: what a session keeps of its owner. Salted, so
    the store never holds a key, nor a hash that a table of common keys would undo."""
    salt = os.urandom(8) if salt is None else salt
    return f"{salt.hex()}:{hashlib.sha256(salt + credential.encode()).hexdigest()}"


def owned_by(tag: str | None, credential: str) -> bool:
    """Whether `credential` is the one `tag` was made of (never, for no tag)."""
    if not tag:
        return False
    salt, _, _ = tag.partition(":")
    return secrets.compare_digest(owner_tag(credential, bytes.fromhex(salt)), tag)


def checked_id(value: Any) -> str:
    """A session id as given, if it can go back in a response header and into logs."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise SessionRefused(f"a session id is a string, got {value!r}", "X-Session-Id")
    text = str(value)
    if len(text) > MAX_SESSION_ID or not (text.isascii() and text.isprintable()):
        raise SessionRefused(
            f"a session id is 1-{MAX_SESSION_ID} printable ASCII characters, got "
            f"{text[:40]!r}{'...' if len(text) > 40 else ''}",
            "X-Session-Id",
        )
    return text


def _affinity(value: str | None) -> str | None:
    """OpenClaw's `<sessionId>:0` to the session id."""
    if not value:
        return None
    head, sep, tail = value.rpartition(":")
    return head if sep and tail.isdigit() and head else value
