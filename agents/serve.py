"""Serve a policy behind the token-exact OpenAI-compatible proxy.

    python -m agents.serve model=tiny serve.port=30000 store=runs/serve/store.sqlite
    python -m agents.serve engine=vllm model=smollm2-135m serve.port=30000
    python -m agents.serve engine=remote engine.base_url=http://127.0.0.1:8000/v1 \
        engine.token_ids=true model.name=MODEL

Hydra composes `ServeRunConfig` from `agents/conf/serve.yaml` and the shared groups
(`model/`, `engine/`) that `trainers.run` and `benchmarks.run` compose too; the components
come from `agents.compose`. The server binds 127.0.0.1 by default; binding beyond loopback
needs `serve.api_key=...` (or `CLAWGYM_API_KEY`). Clients use `http://HOST:PORT/v1` with model
`policy` (or `base`, the adapter switched off). The admin routes (`POST /admin/adapters`...)
take `serve.admin_key` (or `CLAWGYM_ADMIN_KEY`), else a key generated at start and logged.
Connections idle for `serve.idle_timeout_s`, or slower than `serve.request_timeout_s` to send
a request, are closed. Ctrl-C stops the server and the engine.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass, field

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from agents.compose import build_engine, proxy_config
from agents.config import EngineConfig, ModelConfig, ServeSection, serve_key, validate_serve
from agents.serving.app import build_app
from agents.serving.proxy import Proxy
from agents.serving.server import protocol
from agents.store import Store

logger = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0005


@dataclass
class ServeRunConfig:
    """What `python -m agents.serve` serves, and where."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(name="tiny"))
    engine: EngineConfig = field(default_factory=EngineConfig)
    serve: ServeSection = field(default_factory=ServeSection)
    store: str = "runs/serve/store.sqlite"
    """The SQLite file turns are committed to."""
    adapter_shape: str | None = None
    """An adapter directory: make slots for adapters of its shape (rank, target modules) at
    start, so the first published version is copied in as fast as later ones (11-15 ms
    under load against 250-300 ms). Requests on the base model skip peft meanwhile: no
    cost measured."""


def serve(config: ServeRunConfig) -> None:
    """Serves until interrupted (Ctrl-C, SIGTERM)."""
    import uvicorn

    section = dataclasses.replace(config.serve, api_key=serve_key(config.serve))
    validate_serve(section)
    if section.port == 0:
        raise ValueError("serve.port=0 is for servers in a thread; name a port (e.g. 30000)")
    # The engine thread holds the GIL through the Python part of each forward pass; a
    # request thread that wakes meanwhile waits up to the switch interval (5 ms by
    # default) for it, on every hop; 0.5 ms bounds that wait (one paired run at load 23:
    # proxy overhead p50 3.1 ms against 4.0 ms with the default).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    level = section.log_level
    logging.getLogger().setLevel(level.upper())
    engine = build_engine(config.engine, config.model)
    if config.adapter_shape:
        engine.prepare_adapter(config.adapter_shape)
    proxy = Proxy(engine, Store(config.store), proxy_config(section, config.model))
    logger.info(
        "serving %s (%s) on http://%s:%d/v1",
        config.model.name,
        config.engine.backend,
        section.host,
        section.port,
    )
    try:
        uvicorn.run(
            build_app(proxy),
            http=protocol(proxy.config),
            host=section.host,
            port=section.port,
            log_level=level,
            access_log=level.lower() in ("trace", "debug", "info"),
            proxy_headers=False,  # nothing here reads the client's address
        )
    finally:
        engine.close()
        proxy.store.close()


ConfigStore.instance().store(name="serve_schema", node=ServeRunConfig)


@hydra.main(version_base=None, config_path="conf", config_name="serve")
def main(cfg: DictConfig) -> None:
    config: ServeRunConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    serve(config)


if __name__ == "__main__":
    main()
