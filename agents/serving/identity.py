"""A request's session identity: which session it belongs to, its turn type, whether it
closes the session, and who is asking.

`identify` reads a request's session identity. Headers first (`X-Session-Id`,
`X-Turn-Type`, `X-Session-Done`), then OpenClaw's own session headers (`session_id`,
`x-session-affinity`, both `<id>:0`), then body fields of the same names (`session_id`,
`turn_type`, `session_done`), which are removed from the body before anything else sees
it. A session id is 1-256 printable ASCII characters (it goes back in a response header).
No turn type: the configured default (`main`), so a client that sends no headers still
trains, unlike OpenClaw-RL's proxy.

Session ids are scoped by who is asking: the same `X-Session-Id` sent by two clients names
two sessions, so no client can append to, fill or pre-claim another's. A request's
`Authorization` is parsed once (`credential`: the scheme case-insensitive, one canonical
form, compared in constant time). The proxy's own clients (`home`: its key; on a proxy
without keys, no key or the placeholder `none`, which clawgym's own clients send) keep
their ids as sent, so the store's ids are the client's and the episode routes' sessions are
theirs. A user's key (`serve.api_keys`, `agents.api_keys`) scopes by the user it names, so
a user's keys share their sessions; on a proxy without keys, any other credential is a
scope of its own. Such a session is stored as `~<tag>~<id>` (`SessionInfo.stored_id`, the
tag a hash of the user's name or of the credential, never a key), an id no client may send.
Clients that share a key, or send none, are one client.

Only the client that opened a session may close it: its credential is kept in the
session's metadata as a salted hash (`OWNER`); a session the episode routes opened
(`agents.serving.sessions.SessionTracker.open`) has no owner: its admin route ends it.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import uuid
from collections.abc import Collection, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from agents.trajectory import TurnType

MAX_SESSION_ID = 256
_TRUE = {"1", "true", "yes", "on"}
OWNER = "owner"
"""The session metadata key of its owner's credential, salted and hashed (`owner_tag`)."""
NO_KEY = b"Bearer none"
"""What clawgym's own clients send where a server takes no key: no key at all."""
_SCOPED = re.compile(r"~[0-9a-f]{24}~")
"""How a stored id of a credential other than the home one starts; no client id may."""


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
    credential: bytes = field(default=b"", repr=False)
    """The request's canonical credential (`credential`): who is asking (`owner_tag`)."""
    scope: str = ""
    """The credential's tag, or "" for the proxy's own clients (`scope_of`)."""

    @property
    def stored_id(self) -> str:
        """The session's id in the store: the client's id in its credential's scope."""
        return stored_id(self.scope, self.session_id)


def credential(headers: Mapping[str, str]) -> bytes:
    """A request's `Authorization`, canonical: `Bearer <token>` whatever the scheme's case
    and spacing, another scheme as `<scheme in lower case> <rest>`, b"" for none;
    `headers` have lower-case names and latin-1 values (as ASGI servers decode them)."""
    scheme, _, rest = headers.get("authorization", "").encode("latin-1").strip().partition(b" ")
    if not scheme:
        return b""
    if scheme.lower() == b"bearer":
        return b"Bearer " + rest.strip() if rest.strip() else b""
    return scheme.lower() + b" " + rest.strip()


def bearer(key: str) -> bytes:
    """The canonical credential of a request that sends `key` as its bearer token."""
    return b"Bearer " + key.strip().encode()


def is_one_of(given: bytes, credentials: Collection[bytes]) -> bool:
    """Whether `given` is one of `credentials`, each compared in constant time."""
    return any([secrets.compare_digest(given, known) for known in credentials])


def home_credentials(api_key: str | None, users: bool = False) -> frozenset[bytes]:
    """The credentials of a proxy's own clients: its key; without one, none or `none`, unless
    it has `users`' keys (then every client must send a key, and none is home)."""
    if api_key:
        return frozenset({bearer(api_key)})
    return frozenset() if users else frozenset({b"", NO_KEY})


def user_credentials(user_keys: Mapping[str, str]) -> dict[bytes, str]:
    """Users' keys (`agents.api_keys`: key -> user) as the lookup `user_of` takes: the hash of
    each key's canonical credential -> its user."""
    return {_digest(bearer(key)): user for key, user in user_keys.items()}


def user_of(given: bytes, users: Mapping[bytes, str]) -> str | None:
    """The user whose key `given` is (`user_credentials`), if any. Looked up by a hash of the
    credential, so the time taken says nothing of how much of a key was right."""
    return users.get(_digest(given)) if users else None


def scope_of(
    given: bytes, home: Collection[bytes], users: Mapping[bytes, str] | None = None
) -> str:
    """The scope of a credential: empty for a home one; a user's key: 96 bits of a hash of
    the user's name, so that all the user's keys share it; else of the credential. The same
    across restarts, and the key cannot be read back from it (nor guessed, for a real key)."""
    if is_one_of(given, home):
        return ""
    if (user := user_of(given, users or {})) is not None:
        return hashlib.sha256(b"clawgym.user-scope\0" + user.encode()).hexdigest()[:24]
    return hashlib.sha256(b"clawgym.session-scope\0" + given).hexdigest()[:24]


def _digest(given: bytes) -> bytes:
    return hashlib.sha256(b"clawgym.user-key\0" + given).digest()


def stored_id(scope: str, session_id: str) -> str:
    """The store's id of the client's `session_id` in `scope`."""
    return f"~{scope}~{session_id}" if scope else session_id


def client_id(scope: str, stored: str) -> str:
    """The client's id of the store's `stored` id in `scope` (`stored_id` undone)."""
    return stored[len(scope) + 2 :] if scope else stored


def identify(
    headers: Mapping[str, str],
    body: MutableMapping[str, Any],
    default: TurnType,
    home: Collection[bytes] = frozenset({b""}),
    users: Mapping[bytes, str] | None = None,
) -> SessionInfo:
    """The session of a request; pops the body fallbacks so the engine never sees them.
    `home`: the credentials of the proxy's own clients (`home_credentials`); `users`: its
    users' keys (`user_credentials`).

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
        credential=(given := credential(headers)),
        scope=scope_of(given, home, users),
    )


def owner_tag(given: bytes, salt: bytes | None = None) -> str:
    """`salt:sha256(salt + credential)`, hex: what a session keeps of its owner. Salted, so
    the store never holds a key, nor a hash that a table of common keys would undo."""
    salt = os.urandom(8) if salt is None else salt
    return f"{salt.hex()}:{hashlib.sha256(salt + given).hexdigest()}"


def owned_by(tag: str | None, given: bytes) -> bool:
    """Whether the canonical credential `given` is the one `tag` was made of (never, for no
    tag)."""
    if not tag:
        return False
    salt, _, _ = tag.partition(":")
    return secrets.compare_digest(owner_tag(given, bytes.fromhex(salt)), tag)


def checked_id(value: Any) -> str:
    """A session id as given, if it can go back in a response header and into logs."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise SessionRefused(f"a session id is a string, got {value!r}", "X-Session-Id")
    text = str(value)
    if _SCOPED.match(text):
        raise SessionRefused(
            f"a session id may not start like a scoped one (~<24 hex digits>~), got {text[:40]!r}",
            "X-Session-Id",
        )
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
