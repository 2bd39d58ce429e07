"""Typed config of `python -m benchmarks.run`, composed by Hydra from `benchmarks/conf/`.

Every field has a one-line doc; `validate` says how to fix a bad value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from agents.config import EngineConfig, SamplingConfig, validate_engine
from benchmarks.leaderboard.policies import ENGINES, PolicySpec, parse_policy
from benchmarks.leaderboard.suites import TASK_SETS, suite_names


@dataclass
class BenchConfig:
    """The root config."""

    suite: str = "smoke"
    """A family (arith, chat, terminal, gui, ...), full, smoke, or one task set's name."""
    policy: Any = "tiny"
    """One policy spec or a list: policy=tiny or policy=[tiny,adapter:runs/x@all]
    (benchmarks/leaderboard/policies.py lists the forms)."""
    baselines: list[str] = field(default_factory=lambda: ["do-nothing", "oracle"])
    """Added to every leaderboard (oracle only where a task set has one)."""
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(threads=1))
    """The engine of model policies (the shared `engine` group: engine=embedded or
    engine=vllm); a policy's own prefix (`vllm:NAME`) picks another backend. Embedded
    engines run 1 torch thread by default: the engine shares the cores with sandboxes and
    browsers, and OpenMP threads spinning for a busy core cost more than they give (tiny
    decoded 10x faster at 1 thread than at 2 on this 2-core machine under load)."""
    serve: str = "direct"
    """direct: episodes call the engine as training rollouts do; proxy: through the
    token-exact OpenAI-compatible proxy, as live clients do."""
    samples: int = 1
    """Episodes per task (k of pass@k)."""
    limit: int | None = None
    """Cap on tasks per task set (evenly spaced); None: the suite's own."""
    concurrency: int = 4
    """Episodes played at once per policy (the embedded engine batches them)."""
    seed: int = 0
    """Base of every episode's seed."""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0))
    """Greedy by default (pass@1 as usually reported); pass@k with samples > 1 needs > 0."""
    api_key: str | None = None
    """Bearer token for openai: endpoints (or set CLAWGYM_BENCH_API_KEY)."""
    out_dir: str = "runs/leaderboard"
    """Where the results store, trajectories, leaderboard.md and index.html go."""


def policy_specs(config: BenchConfig) -> list[PolicySpec]:
    """Baselines, then the asked policies, each once (by label)."""
    asked = [config.policy] if isinstance(config.policy, str) else list(config.policy or [])
    specs: dict[str, PolicySpec] = {}
    for text in [*config.baselines, *asked]:
        for spec in parse_policy(str(text), config.engine.backend):
            specs.setdefault(spec.label, spec)
    return list(specs.values())


def validate(config: BenchConfig) -> None:
    """Raises ValueError, saying the fix, for any value the benchmark cannot use."""
    if config.suite not in suite_names() and config.suite not in TASK_SETS:
        raise ValueError(f"suite={config.suite!r}: choose one of {', '.join(suite_names())}")
    if not isinstance(config.policy, str | list | tuple):
        raise ValueError("policy must be one spec or a list: policy=tiny or policy=[a,b]")
    validate_engine(config.engine)
    if config.engine.backend not in ENGINES:
        raise ValueError(
            f"engine={config.engine.backend!r}: choose one of {', '.join(ENGINES)} (an "
            "endpoint is a policy: policy=openai:MODEL@URL)"
        )
    if config.serve not in ("direct", "proxy"):
        raise ValueError(f"serve={config.serve!r}: choose serve=direct or serve=proxy")
    if config.samples < 1 or config.concurrency < 1:
        raise ValueError("samples and concurrency must be >= 1")
    if config.limit is not None and config.limit < 1:
        raise ValueError(f"limit must be >= 1 or null, got {config.limit}")
    if config.samples > 1 and config.sampling.temperature == 0:
        raise ValueError(
            f"samples={config.samples} at temperature 0 repeats one episode: set "
            "sampling.temperature=0.6 (or samples=1)"
        )
    policy_specs(config)  # parses every spec: a bad one raises here, before any engine starts


def register_configs() -> None:
    """Makes the typed schema known to Hydra as `bench_schema`."""
    ConfigStore.instance().store(name="bench_schema", node=BenchConfig)
