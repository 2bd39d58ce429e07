"""Serves the Tinker API on clawgym's learner.

    python -m trainers.tinker model=tiny tinker.port=8020 tinker.run_dir=runs/tinker
    python -m trainers.tinker engine=vllm model=smollm2-135m engine.max_lora_rank=32

Hydra composes `TinkerServeConfig` from `trainers/conf/tinker_server.yaml` and the shared
`model/` and `engine/` groups. The LoRA steps run on the CPU learner in this process; the
sampling clients sample in this process too (`engine=embedded`, the default) or through a
vLLM server it starts (`engine=vllm`, from .venv-vllm: each sampler checkpoint is loaded
into vLLM as a LoRA adapter, so `engine.max_lora_rank` must cover the clients' ranks).

Loopback by default; on any other host API keys are required: one (`tinker.api_key=` or
$CLAWGYM_TINKER_API_KEY) or several (`tinker.api_keys=[...]`, `tinker.api_keys_file=`, one
a line, `KEY` or `USER KEY`), each naming its owner, which clients send as TINKER_API_KEY
(the SDK wants a `tml-` prefix). Without keys every client is one owner. `tinker.limits.*`
(`TinkerLimits`) bounds what clients may ask for. Clients point at it with TINKER_BASE_URL=http://127.0.0.1:8020.
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

from agents.api_keys import read_keys
from agents.config import EngineConfig, ModelConfig, is_loopback
from trainers.config import validate_placement
from trainers.tinker.limits import TinkerLimits

logger = logging.getLogger(__name__)


@dataclass
class TinkerSection:
    """Where the Tinker server listens and keeps its checkpoints."""

    host: str = "127.0.0.1"
    port: int = 8020
    run_dir: str = "runs/tinker"
    """Each training client's adapters and tinker:// checkpoints, kept across restarts."""
    api_key: str | None = None
    """A key clients may send (None: $CLAWGYM_TINKER_API_KEY, else none on loopback)."""
    api_keys: list[str] = field(default_factory=list)
    """More keys, `KEY` or `USER KEY` each (`agents.api_keys`): a client sees only the runs,
    checkpoints, samplers and futures its user made."""
    api_keys_file: str | None = None
    """A file of such entries, one a line (blank lines and lines starting with # skipped)."""
    limits: TinkerLimits = field(default_factory=TinkerLimits)
    """Sizes, counts and timeouts per owner and per request (`TinkerLimits`)."""
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
        ValueError: a host beyond loopback without a key, a malformed key entry
            (`agents.api_keys`), or an unknown device or dtype.
    """
    validate_placement("tinker", section.device, section.dtype)
    key = section.api_key or os.environ.get("CLAWGYM_TINKER_API_KEY")
    section = dataclasses.replace(section, api_key=key)
    if not section_users(section) and not is_loopback(section.host):
        raise ValueError(
            f"tinker.host={section.host} is not loopback: set tinker.api_key, tinker.api_keys "
            "or $CLAWGYM_TINKER_API_KEY"
        )
    return section


def section_users(section: TinkerSection) -> dict[str, str]:
    """Every key of the section (`api_key`, `api_keys`, the file's) and the user (owner) it
    names (`agents.api_keys.read_keys`)."""
    entries = [*([section.api_key] if section.api_key else []), *section.api_keys]
    return read_keys(entries, section.api_keys_file, "tinker.api_keys")


def serve(config: TinkerServeConfig) -> None:
    """Serves until interrupted; the vLLM server, if any, stops with it."""
    import uvicorn

    from agents.compose import cuda_available
    from trainers.lora import learner_device
    from trainers.tinker.app import build_app, uvicorn_options
    from trainers.tinker.samplers import build_sampler
    from trainers.tinker.service import TinkerService

    section = checked_section(config.tinker)
    device = learner_device(section.device, cuda_available())
    sampler = build_sampler(config.engine, config.model, shares_gpu=device == "cuda")
    service = TinkerService(
        config.model.name,
        Path(section.run_dir),
        sampler,
        device=device,
        dtype=section.dtype,
        limits=section.limits,
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
            build_app(service, section_users(section)),
            host=section.host,
            port=section.port,
            log_level="warning",
            **uvicorn_options(service),
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
