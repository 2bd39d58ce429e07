"""Serving an ASGI app with uvicorn from a thread of this process: any app
(`uvicorn_in_thread`: the Tinker server's too), or the proxy over an engine (`in_thread`:
how the trainer, the benchmarks and the tests serve it). `protocol` is the HTTP protocol
the proxy is served with, here and by `python -m agents.serve`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from agents.engines.base import Engine
from agents.serving.app import build_app
from agents.serving.http_protocol import http_protocol
from agents.serving.proxy import Proxy, ProxyConfig
from agents.store import Store


@contextlib.contextmanager
def uvicorn_in_thread(
    app: Any, host: str = "127.0.0.1", port: int = 0, **options: Any
) -> Iterator[int]:
    """Serves the ASGI `app` with uvicorn from a daemon thread of this process until the
    block ends (port 0 takes a free one); yields the port. `options` go to uvicorn.Config."""
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", **options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"the server on {host}:{port} did not start")
            time.sleep(0.01)
        yield int(sock.getsockname()[1])
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@contextlib.contextmanager
def in_thread(
    engine: Engine,
    store: Store,
    config: ProxyConfig | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
) -> Iterator[tuple[str, Proxy]]:
    """Serves `engine` from a thread of this process until the block ends (how the trainer
    and the tests start the proxy); port 0 takes a free one. Yields the base URL (`.../v1`)."""
    proxy = Proxy(engine, store, config)
    options = {"http": protocol(proxy.config), "access_log": False, "proxy_headers": False}
    with uvicorn_in_thread(build_app(proxy), host, port, **options) as bound:
        yield f"http://{host}:{bound}/v1", proxy


def protocol(config: ProxyConfig) -> type[asyncio.Protocol]:
    """The HTTP protocol the proxy is served with: writes coalesced, connections that idle
    or send slowly closed (`agents.serving.http_protocol`)."""
    return http_protocol(config.idle_timeout_s, config.request_timeout_s)
