"""An OpenEnv server of a clawgym env, run in-process by uvicorn on a free loopback port,
with the connection limits `python -m envs.openenv serve` gives it."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import uvicorn
from openenv.core.env_server.http_server import HTTPEnvServer

from envs.openenv.limits import ServerLimits, uvicorn_options
from envs.openenv.server import build_app


@dataclass(frozen=True)
class Served:
    """A running server: its URL and OpenEnv's session manager (for its session count)."""

    base_url: str
    sessions: HTTPEnvServer
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        """Stops the server and waits until it has (idempotent)."""
        self.server.should_exit = True
        self.thread.join(timeout=30)


@contextlib.contextmanager
def running(
    env_id: str, env_kwargs: dict[str, Any] | None = None, **options: Any
) -> Iterator[Served]:
    app, sessions = build_app(env_id, env_kwargs, **options)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    limits = options.get("limits") or ServerLimits()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", **uvicorn_options(limits)
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    served = Served(f"http://127.0.0.1:{port}", sessions, server, thread)
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    """Starts servers (`serve(env_id, kwargs, api_key=...)`), all stopped after the test."""
    with contextlib.ExitStack() as stack:
        yield lambda *args, **kwargs: stack.enter_context(running(*args, **kwargs))
