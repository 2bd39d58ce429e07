"""Serve a policy behind the token-exact OpenAI-compatible proxy.

    python -m agents.serve engine=embedded model=tiny port=30000 store=runs/serve/store.sqlite

Arguments are `key=value` pairs of `ServeConfig`'s fields. The server binds 127.0.0.1 by
default; binding beyond loopback needs `api_key=...` (or `CLAWGYM_API_KEY`). Clients use
`http://HOST:PORT/v1` with model `policy` (or `base`, the adapter switched off). Ctrl-C
stops the server and the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, get_type_hints

from agents.engines.base import Engine
from agents.proxy import Proxy, ProxyConfig
from agents.store import Store
from agents.trajectory import TurnType

logger = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class ServeConfig:
    """What `python -m agents.serve` serves, and where."""

    engine: str = "embedded"
    """embedded | vllm | remote."""
    model: str = "tiny"
    """A model name or directory (`agents.models.resolve`); for `remote`, the served name."""
    host: str = "127.0.0.1"
    port: int = 30000
    store: str = "runs/serve/store.sqlite"
    """The SQLite file turns are committed to."""
    api_key: str | None = None
    """Required from clients when set; must be set to bind beyond loopback."""
    turn_type: str = "main"
    """The turn type of requests without `X-Turn-Type`."""
    max_tokens: int = 512
    """Completion budget of requests that set none."""
    session_idle_s: float = 600.0
    """Idle time after which a session's replies that nothing followed are masked."""
    threads: int | None = None
    """torch CPU threads (embedded engine)."""
    max_batch: int = 32
    """Most sequences decoded together (embedded engine)."""
    context_length: int | None = None
    """Longest prompt + completion (embedded engine); None: the model's own. Raise it only
    for test models serving long-prompt clients (OpenClaw needs 16k+)."""
    base_url: str | None = None
    """The upstream server of the `remote` engine."""
    remote_token_ids: bool = False
    """Ask the `remote` upstream for vLLM's token ids (token-exact turns)."""
    adapter_shape: str | None = None
    """An adapter directory: make slots for adapters of its shape (rank, target modules) at
    start, so the first published version is copied in as fast as later ones (11-15 ms
    under load against 250-300 ms). Requests on the base model skip peft meanwhile: no
    cost measured."""
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.engine not in ("embedded", "vllm", "remote"):
            raise ValueError(f"engine must be embedded, vllm or remote, got {self.engine!r}")
        if self.turn_type not in ("main", "side"):
            raise ValueError(f"turn_type must be 'main' or 'side', got {self.turn_type!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if not self.session_idle_s > 0:
            raise ValueError(f"session_idle_s must be positive, got {self.session_idle_s}")
        if not self.api_key and not is_loopback(self.host):
            raise ValueError(
                f"host={self.host} is beyond loopback: set api_key=... (or CLAWGYM_API_KEY)"
            )
        if self.engine == "remote" and not self.base_url:
            raise ValueError("engine=remote needs base_url=http://.../v1")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_args(argv: Sequence[str]) -> ServeConfig:
    """`key=value` arguments to a config; unknown keys and bad values are errors."""
    hints = get_type_hints(ServeConfig)
    values: dict[str, Any] = {"api_key": os.environ.get("CLAWGYM_API_KEY") or None}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in hints:
            names = ", ".join(f.name for f in dataclasses.fields(ServeConfig))
            raise ValueError(f"expected key=value with key one of {names}; got {arg!r}")
        values[key] = _convert(value, hints[key])
    return ServeConfig(**values)


def _convert(value: str, kind: Any) -> Any:
    kinds = getattr(kind, "__args__", (kind,))
    if value.lower() in ("none", "null", "") and type(None) in kinds:
        return None
    if bool in kinds:
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"expected true or false, got {value!r}")
        return value.lower() in ("true", "1")
    if int in kinds:
        return int(value)
    return float(value) if float in kinds else value


def build_engine(config: ServeConfig) -> Engine:
    """The engine the config names."""
    if config.engine == "embedded":
        from agents.engines.embedded import EmbeddedEngine

        return EmbeddedEngine(
            config.model,
            threads=config.threads,
            max_batch=config.max_batch,
            context_length=config.context_length,
        )
    if config.engine == "vllm":
        from agents.engines.vllm import VLLMEngine

        return VLLMEngine(config.model)
    from agents.engines.remote import RemoteEngine

    assert config.base_url is not None  # checked by ServeConfig
    return RemoteEngine(config.base_url, config.model, token_ids=config.remote_token_ids)


def build_proxy(config: ServeConfig, engine: Engine) -> Proxy:
    proxy_config = ProxyConfig(
        model_name=config.model,
        api_key=config.api_key,
        default_turn_type=TurnType(config.turn_type),
        max_tokens=config.max_tokens,
        session_idle_s=config.session_idle_s,
    )
    return Proxy(engine, Store(config.store), proxy_config)


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
    import uvicorn

    from agents.http_protocol import CoalescingHttpProtocol

    proxy = Proxy(engine, store, config)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(
        uvicorn.Config(
            proxy.app,
            http=CoalescingHttpProtocol,
            log_level="warning",
            lifespan="off",
            access_log=False,
            proxy_headers=False,
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the proxy did not start")
            time.sleep(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}/v1", proxy
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    from agents.http_protocol import CoalescingHttpProtocol

    config = parse_args(sys.argv[1:] if argv is None else argv)
    # The engine thread holds the GIL through the Python part of each forward pass; a
    # request thread that wakes meanwhile waits up to the switch interval (5 ms by
    # default) for it, on every hop; 0.5 ms bounds that wait (one paired run at load 23:
    # proxy overhead p50 3.1 ms against 4.0 ms with the default).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    engine = build_engine(config)
    if config.adapter_shape:
        engine.prepare_adapter(config.adapter_shape)
    proxy = build_proxy(config, engine)
    logger.info(
        "serving %s (%s) on http://%s:%d/v1", config.model, config.engine, config.host, config.port
    )
    try:
        uvicorn.run(
            proxy.app,
            http=CoalescingHttpProtocol,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            access_log=config.log_level.lower() in ("trace", "debug", "info"),
            proxy_headers=False,  # nothing here reads the client's address
        )
    finally:
        engine.close()
        proxy.store.close()


if __name__ == "__main__":
    main()
