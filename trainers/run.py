"""The main entry point: `python -m trainers.run [env=...] [model=...] [key=value ...]`.

Until the learning loop lands (issue "The learning loop"), a run is the rollout half of
training, for real and end to end: the policy model, served by the embedded engine,
plays episodes of an environment through its tools; every turn goes token-exactly into
the run's store; the store is exported to parquet, and a summary is printed. Example:

    python -m trainers.run model=tiny env.episodes=2
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import gymnasium as gym
import hydra
from omegaconf import DictConfig, OmegaConf

import envs  # noqa: F401  (registers the clawgym/ environments)
from agents.engines.base import SamplingParams
from agents.engines.embedded import EmbeddedEngine
from agents.rollout import EpisodeSummary, run_episode
from agents.store import Store
from trainers.config import RunConfig, register_configs, validate

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSummary:
    """What a run did, as printed and written to `summary.json`."""

    run_dir: str
    episodes: int
    mean_reward: float
    solved: int
    turns: int
    prompt_tokens: int
    completion_tokens: int
    wall_s: float
    tokens_per_s: float
    store: str
    export: str


def rollouts(config: RunConfig, run_dir: Path) -> RunSummary:
    """Plays `config.env.episodes` episodes with the policy and stores every turn."""
    validate(config)
    started = time.monotonic()
    env = gym.make(config.env.id, **config.env.kwargs)
    engine = EmbeddedEngine(config.model.name, threads=config.engine.threads)
    store = Store(run_dir / "store.sqlite")
    task_ids = list(env.unwrapped.task_ids())  # type: ignore[attr-defined]
    chooser = random.Random(config.seed)
    results: list[EpisodeSummary] = []
    try:
        while len(results) < config.env.episodes:
            task_id = chooser.choice(task_ids)
            group_id = f"group-{len(results)}"
            for _ in range(min(config.env.group_size, config.env.episodes - len(results))):
                sampling = SamplingParams(
                    temperature=config.sampling.temperature,
                    top_p=config.sampling.top_p,
                    max_tokens=config.sampling.max_tokens,
                    seed=config.seed * 100_003 + len(results),
                )
                results.append(
                    run_episode(
                        env,
                        engine,
                        store,
                        env_id=config.env.id,
                        task_id=task_id,
                        seed=config.seed + len(results),
                        group_id=group_id,
                        sampling=sampling,
                    )
                )
        export = store.export_parquet(run_dir / "turns.parquet")
    finally:
        store.close()
        engine.close()
        env.close()
    wall = time.monotonic() - started
    completion_tokens = sum(r.completion_tokens for r in results)
    return RunSummary(
        run_dir=str(run_dir),
        episodes=len(results),
        mean_reward=sum(r.total_reward for r in results) / len(results),
        solved=sum(r.total_reward > 0 for r in results),
        turns=sum(r.turns for r in results),
        prompt_tokens=sum(r.prompt_tokens for r in results),
        completion_tokens=completion_tokens,
        wall_s=round(wall, 2),
        tokens_per_s=round(completion_tokens / wall, 2),
        store=str(run_dir / "store.sqlite"),
        export=str(export),
    )


def _report(summary: RunSummary) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="clawgym run")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in asdict(summary).items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    Console().print(table)


register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    config: RunConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    summary = rollouts(config, run_dir)
    (run_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
    _report(summary)


if __name__ == "__main__":
    main()
