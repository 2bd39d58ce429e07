"""The main entry point: train a policy from interaction.

    python -m trainers.run                                  # embedded defaults
    python -m trainers.run env=chat method=combine model=tiny trainer.max_steps=2
    python -m trainers.run env=arith method=binary env.group_size=4

Hydra composes the typed config of `trainers/config.py` from the groups under
`trainers/conf/` (env, method, model, engine, judge). A run directory receives the
resolved config, the store, the adapters (adapters/v<N>), checkpoints, metrics
(metrics.jsonl and TensorBoard) and summary.json; the same directory resumes a run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import hydra
import torch
from omegaconf import DictConfig, OmegaConf

import envs  # noqa: F401  (registers the clawgym/ environments)
from agents.engines.embedded import EmbeddedEngine
from agents.proxy import Proxy, ProxyConfig
from agents.serve import in_thread
from agents.store import Store
from agents.trajectory import TurnStatus, TurnType
from trainers.config import RunConfig, register_configs, validate
from trainers.judge import build_judge
from trainers.learner import Learner
from trainers.metrics import MetricsWriter
from trainers.pipeline import Pipeline, Progress

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSummary:
    """What a run did, as printed and written to `summary.json`."""

    run_dir: str
    method: str
    steps: int
    adapter_version: int
    episodes: int
    turns_collected: int
    turns_trained: int
    turns_dropped: int
    first_loss: float | None
    last_loss: float | None
    recent_reward: float
    logprob_gap: float | None
    wall_s: float


def train(config: RunConfig, run_dir: Path) -> RunSummary:
    """Runs the pipeline of `config` in `run_dir` until `trainer.max_steps` steps are done."""
    validate(config)
    torch.manual_seed(config.seed)
    started = time.monotonic()
    engine = EmbeddedEngine(config.model.name, threads=config.engine.threads)
    store = Store(run_dir / "store.sqlite")
    metrics = MetricsWriter(run_dir, config.trainer.wandb_project)
    learner = Learner(config.model.name, config.trainer, run_dir)
    # The engine makes its adapter slots now, so that the first publish is a copy like
    # every later one (peft's first load: 60 ms idle, 250-300 ms under load, measured);
    # until then requests skip peft. Outside adapters/, where versions live.
    engine.prepare_adapter(str(learner.save_adapter("adapter-shape")))
    make_env = None
    if config.env.users != "live":
        make_env = lambda: gym.make(config.env.id, **config.env.kwargs)  # noqa: E731
    try:
        with contextlib.ExitStack() as serving:
            publish = None
            if config.env.users == "live" or config.serve.enabled:
                proxy = serving.enter_context(_serve(config, engine, store))
                publish = proxy.publish_adapter
            pipeline = Pipeline(
                config,
                run_dir,
                engine,
                store,
                learner,
                build_judge(config.judge, engine),
                make_env,
                publish=publish,
                metrics=metrics,
            )
            with _live_progress(pipeline.progress, config.trainer.max_steps):
                steps = pipeline.run(overlap=config.trainer.overlap)
        return RunSummary(
            run_dir=str(run_dir),
            method=config.method.name,
            steps=len(steps),
            adapter_version=learner.version,
            episodes=pipeline.progress.episodes,
            turns_collected=store.count_turns(),
            turns_trained=store.count_turns(TurnStatus.TRAINED),
            turns_dropped=store.count_turns(TurnStatus.DROPPED),
            first_loss=steps[0].loss if steps else None,
            last_loss=steps[-1].loss if steps else None,
            recent_reward=round(pipeline.progress.mean_recent_reward, 4),
            logprob_gap=_mean_gap(steps),
            wall_s=round(time.monotonic() - started, 1),
        )
    finally:
        metrics.close()
        store.close()
        engine.close()


@contextlib.contextmanager
def _serve(config: RunConfig, engine: EmbeddedEngine, store: Store) -> Iterator[Proxy]:
    """The serving loop: the proxy on the run's engine and store, in a thread."""
    proxy_config = ProxyConfig(
        model_name=config.model.name,
        api_key=config.serve.api_key,
        default_turn_type=TurnType(config.serve.turn_type),
        max_tokens=config.serve.max_tokens,
        session_idle_s=config.serve.session_idle_s,
    )
    with in_thread(engine, store, proxy_config, config.serve.host, config.serve.port) as (
        url,
        proxy,
    ):
        logger.info("serving the policy at %s (model `policy`; `base` is the adapter off)", url)
        yield proxy


def _mean_gap(steps: list[Any]) -> float | None:
    gaps = [s.logprob_gap for s in steps if s.logprob_gap > 0]
    return sum(gaps) / len(gaps) if gaps else None


class _live_progress:  # noqa: N801 (used as a context manager)
    """A rich progress bar with live reward, loss and throughput, refreshed by a thread."""

    def __init__(self, progress: Progress, total: int):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import (
            Progress as Bar,
        )

        self.progress, self.started = progress, time.monotonic()
        self.bar = Bar(
            TextColumn("training"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
        )
        self.task = self.bar.add_task("", total=total)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, daemon=True)

    def __enter__(self) -> None:
        self.bar.start()
        self._thread.start()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._update()
        self.bar.stop()

    def _refresh(self) -> None:
        while not self._stop.wait(0.5):
            self._update()

    def _update(self) -> None:
        p = self.progress
        loss = f"{p.steps[-1].loss:+.4f}" if p.steps else "-"
        rate = p.turns_judged / max(time.monotonic() - self.started, 1e-6)
        text = (
            f"reward {p.mean_recent_reward:.3f} | loss {loss} | episodes {p.episodes} | "
            f"judged {p.turns_judged} ({rate:.2f}/s) | trained {p.turns_trained}"
        )
        self.bar.update(self.task, completed=len(p.steps), description=text)


def _report(summary: RunSummary) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="clawgym run")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in asdict(summary).items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console().print(table)


register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    config: RunConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    summary = train(config, run_dir)
    (run_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
    _report(summary)


if __name__ == "__main__":
    main()
