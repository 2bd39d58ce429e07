"""Serves the Tinker API on clawgym's learner.

    python -m trainers.tinker model=tiny tinker.port=8020 tinker.run_dir=runs/tinker
    python -m trainers.tinker engine=vllm model=smollm2-135m engine.max_lora_rank=32

Hydra composes `TinkerServeConfig` from `trainers/conf/tinker_server.yaml` and the shared
`model/` and `engine/` groups. The LoRA steps run on the CPU learner in this process; the
sampling clients sample in this process too (`engine=embedded`, the default) or through a
vLLM server it starts (`engine=vllm`, from .venv-vllm: each sampler checkpoint is loaded
into vLLM as a LoRA adapter, so `engine.max_lora_rank` must cover the clients' ranks).

Loopback by default; on any other host an API key is required (`tinker.api_key=` or
$CLAWGYM_TINKER_API_KEY), which clients send as TINKER_API_KEY (the SDK wants a `tml-`
prefix). Clients point at it with TINKER_BASE_URL=http://127.0.0.1:8020.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from agents.config import EngineConfig, ModelConfig, is_loopback
from trainers.config import validate_placement

logger = logging.getLogger(__name__)


@dataclass
class TinkerSection:
    """Where the Tinker server listens and keeps its checkpoints."""

    host: str = "127.0.0.1"
    port: int = 8020
    run_dir: str = "runs/tinker"
    """Each training client's adapters and tinker:// checkpoints, kept across restarts."""
    api_key: str | None = None
    """The key clients must send (None: $CLAWGYM_TINKER_API_KEY, else none on loopback)."""
    device: str = "auto"
    """Where the training clients' learners train: auto (a GPU when torch sees one), cpu
    or cuda. With engine=vllm on the same GPU, vLLM takes half its memory
    (engine.gpu_memory_utilization says otherwise)."""
    dtype: str = "auto"
    """The learners' base weights: auto (bfloat16 on a GPU that has it, else float32),
    float32 or bfloat16."""


@dataclass
class TinkerServeConfig:
    """What `python -m trainers.tinker` serves."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(name="tiny"))
    engine: EngineConfig = field(default_factory=EngineConfig)
    tinker: TinkerSection = field(default_factory=TinkerSection)


def checked_section(section: TinkerSection) -> TinkerSection:
    """The section with the key from the environment where none is set.

    Raises:
        ValueError: a host beyond loopback without a key, or an unknown device or dtype.
    """
    validate_placement("tinker", section.device, section.dtype)
    key = section.api_key or os.environ.get("CLAWGYM_TINKER_API_KEY")
    if key is None and not is_loopback(section.host):
        raise ValueError(
            f"tinker.host={section.host} is not loopback: set tinker.api_key or "
            "$CLAWGYM_TINKER_API_KEY"
        )
    return dataclasses.replace(section, api_key=key)


def serve(config: TinkerServeConfig) -> None:
    """Serves until interrupted; the vLLM server, if any, stops with it."""
    import uvicorn

    from agents.compose import cuda_available
    from trainers.lora import learner_device
    from trainers.tinker.app import build_app
    from trainers.tinker.samplers import build_sampler
    from trainers.tinker.service import TinkerService

    section = checked_section(config.tinker)
    device = learner_device(section.device, cuda_available())
    sampler = build_sampler(config.engine, config.model, shares_gpu=device == "cuda")
    service = TinkerService(
        config.model.name, Path(section.run_dir), sampler, device=device, dtype=section.dtype
    )
    logger.info(
        "serving Tinker on http://%s:%d (%s, learners on %s, sampling on %s)",
        section.host,
        section.port,
        config.model.name,
        device,
        config.engine.backend,
    )
    try:
        uvicorn.run(
            build_app(service, section.api_key),
            host=section.host,
            port=section.port,
            log_level="warning",
        )
    finally:
        service.close()


ConfigStore.instance().store(name="tinker_server_schema", node=TinkerServeConfig)


@hydra.main(version_base=None, config_path="../conf", config_name="tinker_server")
def main(cfg: DictConfig) -> None:
    config: TinkerServeConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    serve(config)


if __name__ == "__main__":
    main()
