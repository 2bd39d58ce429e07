"""A real proxy server for the tests: uvicorn on a free loopback port, in a thread of the
test process (`agents.serving.server.in_thread`), talked to with the official `openai` client."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import openai

from agents.engines.base import Engine
from agents.serving.proxy import ProxyConfig
from agents.serving.server import in_thread as running
from agents.store import Store

__all__ = ["running", "served_client"]


@contextlib.contextmanager
def served_client(
    engine: Engine, directory: Path, config: ProxyConfig | None = None
) -> Iterator[tuple[openai.OpenAI, Store]]:
    """A proxy over `engine` on a fresh store in `directory`: an `openai` client for it (no
    retries, so every failure shows) and the store."""
    with Store(directory / "store.sqlite") as store, running(engine, store, config) as (url, _):
        yield openai.OpenAI(base_url=url, api_key="none", max_retries=0), store
