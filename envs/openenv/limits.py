"""The OpenEnv server's limits: how many sessions it holds, for whom and for how long, and
how long a connection may idle or dawdle.

OpenEnv opens a session (one env instance) per WebSocket (`/ws`, `/mcp`), and, through its
HTTP route `POST /mcp` (`openenv/session/create`, which OpenEnv's `MCPToolClient` uses), a
session that holds no connection and that OpenEnv never expires. `SessionLimiter`, an ASGI
middleware in front of OpenEnv's app, bounds them:

- a global cap (`max_sessions`, 503 past it) and a per-client cap (`max_sessions_per_client`,
  429 past it), counted over both kinds; a client is its key where the server has one (so
  clients that share the key are one client), else its peer address;
- an HTTP-made session belongs to the client that made it: another client naming it gets a
  404, as for an id that does not exist; a session id OpenEnv never gave over HTTP (a
  WebSocket's) is not reachable over HTTP;
- an HTTP-made session idle for `session_idle_s` is closed, and its env with it.

A WebSocket's session lives as long as its connection: uvicorn closes it when the peer is
gone (its pings go unanswered), and this middleware when the peer, alive, sends no message
for `websocket_idle_s` while the server waits for one (`_idle_closing`). HTTP connections
that idle or send slowly are closed by `envs.connections.TimedHttpProtocol`, the protocol
the proxy's server uses too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from openenv.core.env_server.http_server import HTTPEnvServer
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from envs.connections import TimedHttpProtocol, timed_protocol

logger = logging.getLogger(__name__)

SESSION_ROUTES = ("/ws", "/mcp")
"""The WebSocket routes that open a session per connection."""
IDLE_CLOSE = 1001
"""The close code of a WebSocket closed for saying nothing ("going away")."""


@dataclass(frozen=True)
class ServerLimits:
    """The OpenEnv server's limits; each has a documented default (docs/serving.md)."""

    max_sessions: int = 8
    """Sessions (env instances) open at once, over WebSockets and HTTP; 503 past it."""
    max_sessions_per_client: int = 4
    """Sessions one client (its key, or without keys its peer address) holds; 429 past it."""
    session_idle_s: float = 600.0
    """An HTTP-made session without a request for this long is closed, with its env."""
    websocket_idle_s: float = 600.0
    """A WebSocket that sends no message for this long while the server waits for one is
    closed (code 1001), and its session and env with it."""
    idle_timeout_s: float = 30.0
    """A connection with no request under way is closed after this long."""
    request_timeout_s: float = 60.0
    """A request's head and body must arrive within this long of its first byte."""
    max_body_bytes: int = 1 << 20
    """Larger `POST /mcp` bodies are refused (413) before they are parsed."""

    def __post_init__(self) -> None:
        counts = (self.max_sessions, self.max_sessions_per_client, self.max_body_bytes)
        times = (
            self.session_idle_s,
            self.websocket_idle_s,
            self.idle_timeout_s,
            self.request_timeout_s,
        )
        if min(counts) < 1 or not all(t > 0 for t in times):
            raise ValueError(
                f"max_sessions, max_sessions_per_client and max_body_bytes must be at least 1 "
                f"and the timeouts positive, got {counts} and {times}"
            )


class SessionLimiter:
    """ASGI middleware: the session caps, HTTP sessions' owners and their idle expiry.

    Args:
        app: OpenEnv's app.
        sessions: OpenEnv's session manager behind it (closes expired sessions).
        limits: the caps and the idle limit.
        keyed: the server has a key: a client is its `Authorization`, else its address.
    """

    def __init__(self, app: ASGIApp, sessions: HTTPEnvServer, limits: ServerLimits, keyed: bool):
        self.app, self.sessions, self.limits, self.keyed = app, sessions, limits, keyed
        self.held: Counter[str] = Counter()
        """Sessions each client holds (WebSockets open, HTTP sessions not closed)."""
        self.owners: dict[str, str] = {}
        """HTTP-made session id -> its client."""
        self.seen: dict[str, float] = {}
        """HTTP-made session id -> when it last had a request (monotonic)."""
        self._reaper: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(self._expire_idle())
        if scope["type"] == "websocket" and scope["path"] in SESSION_ROUTES:
            await self._websocket(scope, receive, send)
        elif scope["type"] == "http" and scope["path"] == "/mcp" and scope["method"] == "POST":
            await self._mcp(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def client(self, scope: Scope) -> str:
        """Who is asking: the key they sent, or without keys their address."""
        if self.keyed:
            return dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        return str((scope.get("client") or ("?",))[0])

    def refusal(self, client: str) -> tuple[int, str] | None:
        """Why `client` may not open one more session (status, message), if it may not."""
        if sum(self.held.values()) >= self.limits.max_sessions:
            return 503, f"the server holds its {self.limits.max_sessions} sessions; retry later"
        if self.held[client] >= self.limits.max_sessions_per_client:
            return 429, (
                f"this client holds {self.held[client]} sessions, the most one client may "
                f"(max_sessions_per_client); close one first"
            )
        return None

    def _release(self, client: str) -> None:
        self.held[client] -= 1
        if self.held[client] <= 0:
            del self.held[client]

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = self.client(scope)
        if (refused := self.refusal(client)) is not None:
            await _deny_websocket(scope, receive, send, *refused)
            return
        self.held[client] += 1  # no await since the check: no other request came between
        try:
            await self.app(scope, *_idle_closing(receive, send, self.limits.websocket_idle_s))
        finally:
            self._release(client)

    async def _mcp(self, scope: Scope, receive: Receive, send: Send) -> None:
        client, body = self.client(scope), await _body(receive, self.limits.max_body_bytes)
        if body is None:
            await _json(scope, send, 413, f"the body is over {self.limits.max_body_bytes} bytes")
            return
        method, session_id = _rpc_fields(body)
        if session_id is not None and self.owners.get(session_id) != client:
            await _json(scope, send, 404, f"unknown session_id: {session_id}")
            return
        if method == "openenv/session/create" and session_id is None:
            await self._create(scope, body, send, client)
            return
        if session_id is not None:
            self.seen[session_id] = time.monotonic()
        reply = await _forward(self.app, scope, body, send)
        if method == "openenv/session/close" and session_id is not None and _result(reply):
            self._forget(session_id)

    async def _create(self, scope: Scope, body: bytes, send: Send, client: str) -> None:
        if (refused := self.refusal(client)) is not None:
            await _json(scope, send, *refused)
            return
        self.held[client] += 1
        created = _result(await _forward(self.app, scope, body, send)).get("session_id")
        if isinstance(created, str):
            self.owners[created], self.seen[created] = client, time.monotonic()
        else:
            self._release(client)

    def _forget(self, session_id: str) -> None:
        if (client := self.owners.pop(session_id, None)) is not None:
            self.seen.pop(session_id, None)
            self._release(client)

    async def _expire_idle(self) -> None:
        """Closes HTTP-made sessions idle for `session_idle_s`, and their envs."""
        idle = self.limits.session_idle_s
        while True:
            await asyncio.sleep(min(max(idle / 4, 0.05), 30.0))
            now = time.monotonic()
            for session_id in [s for s, t in self.seen.items() if now - t >= idle]:
                self._forget(session_id)
                try:
                    await self.sessions._destroy_session(session_id)  # OpenEnv's own close
                    logger.info("closed the HTTP session %s: idle for %.0f s", session_id, idle)
                except Exception:
                    logger.exception("closing the idle session %s failed", session_id)


def _idle_closing(receive: Receive, send: Send, idle_s: float) -> tuple[Receive, Send]:
    """A WebSocket's `receive` and `send` that close it when the client sends nothing for
    `idle_s` while the app waits for a message: the client gets a close frame (1001), the
    app a disconnect (so OpenEnv closes the session and its env), and what the app sends
    after it is dropped. uvicorn's pings keep a quiet but live peer open, so without this
    a client could hold a session for ever by saying nothing. The clock runs only while the
    app waits, so a long env step is never counted against its client."""
    closed = False

    async def timed_receive() -> Message:
        nonlocal closed
        if closed:
            return {"type": "websocket.disconnect", "code": IDLE_CLOSE}
        try:
            return await asyncio.wait_for(receive(), idle_s)
        except TimeoutError:
            closed = True
        logger.info("closed a WebSocket session: no message for %.0f s", idle_s)
        reason = f"no message for {idle_s:g} s (websocket_idle_s)"
        await send({"type": "websocket.close", "code": IDLE_CLOSE, "reason": reason})
        return {"type": "websocket.disconnect", "code": IDLE_CLOSE}

    async def guarded_send(message: Message) -> None:
        if not closed:
            await send(message)

    return timed_receive, guarded_send


async def _body(receive: Receive, limit: int) -> bytes | None:
    """The request's body, or None past `limit` bytes."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        size, more = size + len(chunks[-1]), message.get("more_body", False)
        if size > limit or message["type"] == "http.disconnect":
            return None
    return b"".join(chunks)


def _rpc_fields(body: bytes) -> tuple[Any, str | None]:
    """A JSON-RPC body's method and `params.session_id` (None where there is none)."""
    try:
        request = json.loads(body)
    except ValueError:
        return None, None  # OpenEnv answers it with its parse error
    params = request.get("params") if isinstance(request, dict) else None
    session_id = params.get("session_id") if isinstance(params, dict) else None
    return request.get("method"), (str(session_id) if session_id else None)


def _result(reply: bytes) -> dict[str, Any]:
    """The `result` of a JSON-RPC response body ({} for an error)."""
    try:
        result = json.loads(reply).get("result")
    except (ValueError, AttributeError):
        return {}
    return result if isinstance(result, dict) else {}


async def _forward(app: ASGIApp, scope: Scope, body: bytes, send: Send) -> bytes:
    """Serves the request with its body read already; returns the response's body."""
    sent: list[bytes] = []

    async def replay() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    async def keep(message: Message) -> None:
        if message["type"] == "http.response.body":
            sent.append(message.get("body", b""))
        await send(message)

    await app(scope, replay, keep)
    return b"".join(sent)


async def _json(scope: Scope, send: Send, status: int, detail: str) -> None:
    async def nothing() -> Message:
        return {"type": "http.disconnect"}

    await JSONResponse({"detail": detail}, status)(scope, nothing, send)


async def _deny_websocket(
    scope: Scope, receive: Receive, send: Send, status: int, detail: str
) -> None:
    """Refuses a WebSocket handshake with an HTTP status (a close where the server cannot)."""
    await receive()  # websocket.connect
    logger.warning("refused a session to %s: %s", scope.get("client"), detail)
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1013, "reason": detail[:120]})
        return
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body})


def uvicorn_options(limits: ServerLimits) -> dict[str, Any]:
    """uvicorn.Config's options that apply `limits` to connections."""

    protocol = timed_protocol(TimedHttpProtocol, limits.idle_timeout_s, limits.request_timeout_s)
    return {"http": protocol, "ws": "websockets"}  # websockets: refusals as HTTP statuses
