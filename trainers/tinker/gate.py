"""The Tinker server's door, in plain ASGI before any route: who the caller is (its API key,
one owner per key) and how much it may send (`max_body_bytes`, refused while the body is
read: a declared Content-Length over it at once, otherwise when the bytes received pass it).

With no key configured every caller is the one owner `local` (the server then listens on
loopback only); with keys, a request without one of them answers 401. A key's owner is the
user it names (`agents.api_keys`: a name given with the key, else a hash of the key), so run
records on disk never hold a key and a user's runs are theirs whichever of their keys asks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from agents.api_keys import KEYLESS_USER
from trainers.tinker.errors import TooLarge

OWNER = "tinker.owner"
"""The scope's state entry naming the request's owner."""


class Gate:
    """ASGI middleware: 401 without a configured key, 413 past the body limit; puts the
    caller's owner in the request's state (`request.state` as `OWNER`)."""

    def __init__(self, app: Any, users: Mapping[str, str], max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes
        self._owners = {hashlib.sha256(k.encode()).digest(): user for k, user in users.items()}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        owner = self._owner(headers.get(b"x-api-key", b""))
        if owner is None:
            await _answer(send, 401, "invalid or missing X-API-Key")
            return
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit():
            await _answer(send, 400, f"malformed Content-Length {declared!r}")
            return
        if int(declared) > self.max_body_bytes:
            await _answer(send, 413, self._too_large().args[0])
            return
        scope.setdefault("state", {})[OWNER] = owner
        await self.app(scope, self._counted(receive), send)

    def _owner(self, supplied: bytes) -> str | None:
        """The supplied key's owner; the raw header bytes are hashed, so any byte is fine."""
        if not self._owners:
            return KEYLESS_USER
        return self._owners.get(hashlib.sha256(supplied).digest())

    def _counted(self, receive: Any) -> Any:
        received = 0

        async def counted() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                raise self._too_large()
            return message

        return counted

    def _too_large(self) -> TooLarge:
        return TooLarge(
            f"the body is over {self.max_body_bytes} bytes (tinker.limits.max_body_bytes)"
        )


async def _answer(send: Any, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
