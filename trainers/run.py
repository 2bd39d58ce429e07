"""The main entry point: train a policy from interaction.

    python -m trainers.run                                  # embedded defaults
    python -m trainers.run env=chat method=combine model=tiny trainer.max_steps=2
    python -m trainers.run env=arith method=binary env.group_size=4
    python -m trainers.run engine=vllm model=tiny env=chat method=binary trainer.max_steps=2
    python -m trainers.run cluster=ray env=[arith,terminal]   # rollout workers on Ray
    TINKER_BASE_URL=http://127.0.0.1:8020 TINKER_API_KEY=tml-local \
        python -m trainers.run backend=tinker model=tiny env=chat method=combine

Hydra composes the typed config of `trainers/config.py` from the groups under
`trainers/conf/` (method, judge, cluster, backend) and the shared ones of `agents/conf/`
(env, model, engine). `backend=tinker` samples, scores and takes the LoRA steps on a Tinker
service (`trainers.tinker_learner`), clawgym's own (`python -m trainers.tinker`) or another.
A run directory receives the resolved config, the store, the adapters (adapters/v<N>),
checkpoints, metrics (metrics.jsonl and TensorBoard) and summary.json; the same command on
the same directory resumes a run, even one killed with SIGKILL, and its summary.json counts
the whole run.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from agents.demonstrations import DEMONSTRATION
from agents.store import Store
from agents.trajectory import SessionStatus, TurnStatus
from trainers.compose import (
    build_judges,
    build_learner_and_engine,
    build_pipeline,
    cluster_session,
    serving,
)
from trainers.config import RunConfig, register_configs, validate
from trainers.metrics import MetricsWriter, Record, read_metrics, step_rows
from trainers.pipeline import Pipeline
from trainers.progress import Progress, episode_summary, learning_health

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSummary:
    """What a run did, as printed and written to `summary.json`.

    The run's totals come from its durable record (checkpoint, store, metrics.jsonl), so a
    run resumed after a kill reports all of it; the fields that say "this process" are the
    figures of the process that finished it.
    """

    run_dir: str
    method: str
    engine: str
    steps: int
    """Optimiser steps of the whole run (the checkpoint's; one row each in metrics.jsonl)."""
    adapter_version: int
    episodes: int
    """Episodes of the run's envs that ended, from the store."""
    turns_collected: int
    turns_trained: int
    turns_dropped: int
    first_loss: float | None
    last_loss: float | None
    recent_reward: float
    """Mean reward of the last 32 episodes this process played."""
    logprob_gap: float | None
    """Mean |learner - rollout| log-prob per token of on-policy turns, over the steps."""
    logprob_gap_max: float | None
    """The largest such gap of any one token."""
    wall_s: float
    """This process's wall time."""
    envs: dict[str, dict[str, Any]]
    """Per env, of this process: its episodes (count, reward, success rate, turns and
    tokens per episode, wall time, failed and truncated) and its turns trained and dropped."""
    held_out: dict[str, dict[str, Any]]
    """Per env: its held-out score before (None with `eval.before` off) and after training
    (with `eval.episodes`)."""


def train(config: RunConfig, run_dir: Path) -> RunSummary:
    """Runs the pipeline of `config` in `run_dir` until `trainer.max_steps` steps are done.

    Every component comes from the composition root (`trainers.compose`, which builds
    engines, proxies and envs through `agents.compose`). The policy is always served behind
    the proxy: the run's own rollouts reach it over HTTP like any client, so the proxy is
    the one writer of turns.
    """
    validate(config)
    with cluster_session(config):
        return _train(config, run_dir)


def _train(config: RunConfig, run_dir: Path) -> RunSummary:
    torch.manual_seed(config.seed)
    started = time.monotonic()
    learner, engine = build_learner_and_engine(config, run_dir)
    store = Store(run_dir / "store.sqlite")
    metrics = MetricsWriter(run_dir, config.trainer.wandb_project)
    # The engine makes its adapter slots now, so that the first publish is a copy like
    # every later one (peft's first load: 60 ms idle, 250-300 ms under load, measured);
    # until then requests skip peft. Outside adapters/, where versions live.
    engine.prepare_adapter(str(learner.save_adapter("adapter-shape")))
    judges = build_judges(config.judge, config.env, engine)
    try:
        with serving(config, engine, store) as served:
            pipeline = build_pipeline(config, run_dir, store, learner, judges, served, metrics)
            with _live_progress(pipeline.progress, pipeline.total_steps):
                pipeline.run(overlap=config.trainer.overlap)
        return _summary(config, run_dir, store, pipeline, time.monotonic() - started)
    finally:
        metrics.close()
        store.close()
        engine.close()


def _summary(
    config: RunConfig, run_dir: Path, store: Store, pipeline: Pipeline, wall_s: float
) -> RunSummary:
    """The run's summary, from its durable record and this process's pipeline."""
    # every step's row, the killed processes' too (this process holds only its own)
    steps = step_rows(read_metrics(run_dir))
    learner, evaluator = pipeline.learner, pipeline.evaluator
    return RunSummary(
        run_dir=str(run_dir),
        method=config.method.name,
        engine="tinker" if config.backend.kind == "tinker" else config.engine.backend,
        steps=learner.step_count,
        adapter_version=learner.version,
        episodes=_episodes(store, config.env),
        turns_collected=store.count_turns(),
        turns_trained=store.count_turns(TurnStatus.TRAINED),
        turns_dropped=store.count_turns(TurnStatus.DROPPED),
        first_loss=steps[0]["loss"] if steps else None,
        last_loss=steps[-1]["loss"] if steps else None,
        recent_reward=round(pipeline.progress.mean_recent_reward, 4),
        logprob_gap=_mean_gap(steps),
        logprob_gap_max=max((s["logprob_gap_max"] for s in steps), default=None),
        wall_s=round(wall_s, 1),
        envs=_env_summaries(pipeline.progress),
        held_out=evaluator.before_after() if evaluator is not None else {},
    )


def _env_summaries(progress: Progress) -> dict[str, dict[str, Any]]:
    return {
        name: episode_summary(env.episodes)
        | {"turns_trained": env.turns_trained, "turns_dropped": env.turns_dropped}
        for name, env in progress.by_env.items()
    }


def _mean_gap(steps: list[Record]) -> float | None:
    gaps = [s["logprob_gap"] for s in steps if s["logprob_gap"] > 0]
    return sum(gaps) / len(gaps) if gaps else None


def _episodes(store: Store, envs: Iterable[str]) -> int:
    """Episodes of `envs` that ended, whichever process played them: not a warm start's
    demonstrations, nor held-out evaluations (`eval/<env>`), nor live conversations."""
    names = set(envs)
    return sum(
        s.env_id in names and s.status != SessionStatus.OPEN and DEMONSTRATION not in s.metadata
        for s in store.sessions()
    )


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
        score = p.mean_recent_judge_score
        text = (
            f"reward {p.mean_recent_reward:.3f} | judge {'-' if score is None else f'{score:+.2f}'}"
            f" | loss {loss} | episodes {p.episodes} | judged {p.turns_judged} ({rate:.2f}/s)"
            f" | trained {p.turns_trained}"
        )
        text += learning_health(p)
        if len(p.by_env) > 1:  # a mixture: each env's episodes and recent reward
            text += " | " + " ".join(
                f"{name} {len(env.episodes)}:{env.mean_recent_reward:.2f}"
                for name, env in p.by_env.items()
            )
        self.bar.update(self.task, completed=len(p.steps), description=text)


def _held_out(score: dict[str, Any] | None) -> str:
    """One held-out evaluation as the summary shows it; '-' for a before not taken."""
    if score is None:
        return "- (eval.before off)"
    shown = f"pass@1 {score['pass_at_1']:.3f} [{score['low']:.3f}, {score['high']:.3f}]"
    if score.get("pass_at_k") is not None:
        shown += (
            f", pass@{score['k']} {score['pass_at_k']:.3f} "
            f"[{score['pass_at_k_low']:.3f}, {score['pass_at_k_high']:.3f}]"
        )
    return shown + f", reward {score['reward']:.3f} (n={score['episodes']})"


def gain(start: dict[str, Any] | None, end: dict[str, Any] | None) -> str:
    """What a stretch of training gave held-out pass@1, and whether the two 95% intervals
    are disjoint (the gain is then beyond the noise of n tasks)."""
    if start is None or end is None:
        return "-"
    delta = end["pass_at_1"] - start["pass_at_1"]
    apart = end["low"] > start["high"] or end["high"] < start["low"]
    return f"{delta:+.3f} ({'intervals disjoint' if apart else 'intervals overlap'})"


def _held_out_rows(name: str, scores: dict[str, Any]) -> list[tuple[str, str]]:
    """The final table's rows of one env's held-out evaluations: before, at the switch from
    imitation to RL, after, and what each phase gave."""
    before, switch, after = scores["before"], scores.get("switch"), scores["after"]
    rows = [(f"held-out {name} before", _held_out(before))]
    if switch is not None:
        rows += [
            (f"held-out {name} after imitation (step {switch['step']})", _held_out(switch)),
            (f"held-out {name} after RL (step {after['step']})", _held_out(after)),
            (f"held-out {name}: imitation gave", gain(before, switch)),
            (f"held-out {name}: RL gave", gain(switch, after)),
        ]
    else:
        rows += [
            (f"held-out {name} after (step {after['step']})", _held_out(after)),
            (f"held-out {name}: training gave", gain(before, after)),
        ]
    if len(scores["curve"]) > 2:
        rows.append(
            (
                f"held-out {name} by step",
                ", ".join(
                    f"{step}: {p1:.3f}" + ("" if pk is None else f"/{pk:.3f}")
                    for step, p1, pk in scores["curve"]
                ),
            )
        )
    return rows


def _report(summary: RunSummary) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="clawgym run")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in asdict(summary).items():
        if key == "held_out":
            for name, scores in value.items():
                for row in _held_out_rows(name, scores):
                    table.add_row(*row)
            continue
        if key == "envs":
            for name, figures in value.items():
                shown = ", ".join(f"{k} {_shown(v)}" for k, v in figures.items() if v is not None)
                table.add_row(f"env {name}", shown)
            continue
        table.add_row(key, _shown(value))
    Console().print(table)


def _shown(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    # the rollouts' HTTP clients would log every request at INFO
    for chatty in ("httpx", "httpx2", "openai"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    config: RunConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    summary = train(config, run_dir)
    (run_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
    _report(summary)


if __name__ == "__main__":
    main()
