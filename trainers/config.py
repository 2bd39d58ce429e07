"""Typed configs of `python -m trainers.run`, composed by Hydra from `trainers/conf/`.

Each component receives its own sub-config. Every field has a one-line doc, and
`validate` says how to fix a bad value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore


@dataclass
class EnvConfig:
    """Which environment the rollouts play."""

    id: str = "clawgym/Arith-v0"
    """A registered gymnasium id (`clawgym/<Name>-v0`)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Registration kwargs of the variant, e.g. {split: test, max_turns: 4}."""
    episodes: int = 4
    """Episodes to play."""
    group_size: int = 1
    """Rollouts per task sharing a group id (the GRPO baseline is taken over a group)."""


@dataclass
class ModelConfig:
    """The policy's base model."""

    name: str = "smollm2-135m"
    """A name `agents.models.resolve` knows (tiny, smollm2-135m), a directory or a hub id."""


@dataclass
class EngineConfig:
    """How the policy is served."""

    backend: str = "embedded"
    """Only `embedded` (transformers in process) so far; vllm and remote come with serving."""
    threads: int | None = None
    """torch CPU threads for the embedded engine (None: torch's default)."""


@dataclass
class SamplingConfig:
    """Sampling of every policy turn."""

    temperature: float = 0.6
    """0 is greedy; OpenClaw-RL samples at 0.6."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_tokens: int = 96
    """Tokens per assistant turn."""


@dataclass
class RunConfig:
    """The root config."""

    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0
    """Seeds task choice and sampling."""
    run_dir: str = "runs/${now:%Y%m%d-%H%M%S}"
    """Where the store, the export and the resolved config go."""


def validate(config: RunConfig) -> None:
    """Raises ValueError, saying the fix, for any value the run cannot use."""
    if config.env.episodes < 1:
        raise ValueError(
            f"env.episodes must be >= 1, got {config.env.episodes}; set env.episodes=4"
        )
    if config.env.group_size < 1:
        raise ValueError(f"env.group_size must be >= 1, got {config.env.group_size}")
    if config.engine.backend != "embedded":
        raise ValueError(
            f"engine.backend={config.engine.backend!r} is not available yet; use engine=embedded"
        )
    if not config.env.id.startswith("clawgym/"):
        raise ValueError(f"env.id must be a clawgym/ id, got {config.env.id!r}")


def register_configs() -> None:
    """Makes the typed schema known to Hydra as `run_schema`."""
    ConfigStore.instance().store(name="run_schema", node=RunConfig)
