"""The connection limits of every HTTP server clawgym runs: a uvicorn protocol that closes
connections which hold a file and do nothing.

uvicorn arms its keep-alive timer only after a response, so a connection that never sends a
request was kept for ever, and it has no timer at all on receiving a request, so a client
that sends a byte at a time kept one as long as it liked (20,400 idle connections exhausted
the proxy's file limit, and 200 slow clients were never closed). `TimedHttpProtocol` gives
uvicorn's httptools protocol two limits: `idle_timeout_s` (no request under way, from the
connection's start too) and `request_timeout_s` (a request's head and body, from its first
byte). A WebSocket upgrade hands the connection to uvicorn's WebSocket protocol, and the
request clock stops there.

It lives here, the lowest layer, because the OpenEnv server (`envs.openenv`) and the policy's
proxy (`agents.serving.http_protocol`, which also coalesces writes) both serve with it, and
envs import nothing from agents. `timed_protocol` makes the class with given limits.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, TypeVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)


class TimedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing a connection idle for `idle_timeout_s` (from
    its start too) or taking over `request_timeout_s` to send a request's head and body."""

    idle_timeout_s: float = 30.0
    """A connection with no request under way is closed after this long without a byte."""
    request_timeout_s: float = 60.0
    """A request's head and body must have arrived this long after its first byte."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn's keep-alive timer, armed after each response, gets the same limit as a
        # connection that has not sent a request yet (uvicorn's own setting is in whole
        # seconds: the tests use fractions).
        self.timeout_keep_alive = self.idle_timeout_s  # type: ignore[assignment]
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def data_received(self, data: bytes) -> None:
        # The first byte of a request starts its clock; bytes that come while a response
        # is under way (a pipelined request) start it when that response is over, as the
        # keep-alive timer does.
        if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
            self._deadline = self.loop.call_later(self.request_timeout_s, self._too_slow)
        super().data_received(data)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._stop_deadline()

    def handle_websocket_upgrade(self) -> None:
        self._stop_deadline()  # the WebSocket protocol takes the connection over
        super().handle_websocket_upgrade()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_deadline()
        super().connection_lost(exc)

    def _stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        """Closes a connection whose request did not arrive in time; a request the app is
        reading the body of sees the client leave."""
        self._deadline = None
        if not self.transport.is_closing():
            logger.info(
                "closed a connection from %s: its request took over %.0f s to arrive",
                self.client,
                self.request_timeout_s,
            )
            self.transport.close()


P = TypeVar("P", bound=TimedHttpProtocol)


def timed_protocol(base: type[P], idle_timeout_s: float, request_timeout_s: float) -> type[P]:
    """`base` with these limits, for uvicorn's `http=` (it makes a protocol per connection
    from a class, with its own arguments only)."""
    if not (idle_timeout_s > 0 and request_timeout_s > 0):
        raise ValueError(
            f"idle_timeout_s and request_timeout_s must be positive, got {idle_timeout_s} "
            f"and {request_timeout_s}"
        )
    limits = {"idle_timeout_s": idle_timeout_s, "request_timeout_s": request_timeout_s}
    return type(base.__name__, (base,), limits)
