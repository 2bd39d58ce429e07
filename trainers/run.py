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

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from agents.compose import build_engine, env_factory, serve_key, serve_policy, split_cpus
from agents.config import EnvConfig, ServeSection
from agents.demonstrations import DEMONSTRATION
from agents.engines.base import Engine
from agents.engines.vllm_command import own_cpus
from agents.seats import ProxySeat
from agents.store import Store
from agents.trajectory import SessionStatus, TurnStatus, TurnType
from trainers.config import RunConfig, register_configs, validate
from trainers.evaluation import Evaluator
from trainers.judge import build_judge
from trainers.learner import Learner
from trainers.metrics import MetricsWriter, Record, read_metrics, step_rows
from trainers.pipeline import Pipeline
from trainers.progress import Progress, episode_summary, learning_health
from trainers.rollouts import EpisodePlayer, LocalPlayer

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

    Every component comes from the composition root (`agents.compose`) or, on the trainer's
    side, from its own builder. The policy is always served behind the proxy: the run's own
    rollouts reach it over HTTP like any client, so the proxy is the one writer of turns.
    """
    validate(config)
    with cluster_session(config):
        return _train(config, run_dir)


def _train(config: RunConfig, run_dir: Path) -> RunSummary:
    torch.manual_seed(config.seed)
    started = time.monotonic()
    learner, engine = _learner_and_engine(config, run_dir)
    store = Store(run_dir / "store.sqlite")
    metrics = MetricsWriter(run_dir, config.trainer.wandb_project)
    # The engine makes its adapter slots now, so that the first publish is a copy like
    # every later one (peft's first load: 60 ms idle, 250-300 ms under load, measured);
    # until then requests skip peft. Outside adapters/, where versions live.
    engine.prepare_adapter(str(learner.save_adapter("adapter-shape")))
    live = any(env.users == "live" for env in config.env.values())
    judge = build_judge(config.judge, engine)
    judges_by_env = {
        name: build_judge(dataclasses.replace(config.judge, kind=env.judge), engine)
        for name, env in config.env.items()
        if env.judge is not None and env.judge != config.judge.kind
    }
    try:
        with (
            serve_policy(engine, store, _served(config, live), config.model.name) as (
                url,
                proxy,
            ),
            contextlib.closing(
                ProxySeat(url, serve_key(config.serve), admin_key=proxy.admin_key)
            ) as seat,
            contextlib.closing(
                ProxySeat(
                    url,
                    serve_key(config.serve),
                    turn_type=TurnType.SIDE,
                    admin_key=proxy.admin_key,
                )
            ) as eval_seat,
            contextlib.ExitStack() as stack,
        ):
            simulated = {
                name: with_run_endpoint(env, url, serve_key(config.serve))
                for name, env in config.env.items()
                if env.users == "simulated"
            }
            make_envs = {name: env_factory(env) for name, env in simulated.items()}
            player = stack.enter_context(
                rollout_player(config, simulated, url, proxy.admin_key, seat)
            )
            evaluator = Evaluator(
                config.eval,
                simulated,
                env_factory,
                eval_seat,
                config.sampling,
                metrics,
                run_dir,
                store,
            )
            pipeline = Pipeline(
                config,
                run_dir,
                store,
                learner,
                judge,
                judges_by_env,
                make_envs,
                player=player,
                publish=proxy.publish_adapter,
                metrics=metrics,
                evaluator=evaluator,
            )
            with _live_progress(pipeline.progress, pipeline.total_steps):
                pipeline.run(overlap=config.trainer.overlap)
        # every step's row, the killed processes' too (this process holds only its own)
        steps = step_rows(read_metrics(run_dir))
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
            wall_s=round(time.monotonic() - started, 1),
            envs=_env_summaries(pipeline.progress),
            held_out=evaluator.before_after(),
        )
    finally:
        metrics.close()
        store.close()
        engine.close()


RUN_ENDPOINT = "run"
"""`user_base_url: run` in an env's kwargs: its user model is the run's own policy server."""


def with_run_endpoint(env: EnvConfig, url: str, api_key: str | None) -> EnvConfig:
    """The env with `user_base_url: run` pointed at the run's proxy: a model-driven user
    (tau2's) played by the policy's base model (adapter off: `base`, never trained; its
    requests are side turns), as tau2 intends its user to be a model."""
    if env.kwargs.get("user_base_url") != RUN_ENDPOINT:
        return env
    kwargs = env.kwargs | {"user_base_url": url, "user_api_key": api_key or "none"}
    kwargs.setdefault("user_model", "base")  # the proxy's name for the adapter off
    return dataclasses.replace(env, kwargs=kwargs)


def _served(config: RunConfig, live: bool) -> ServeSection:
    """Where the proxy listens: the configured address when clients are to reach it (live
    users, `serve.enabled`, rollout workers of other machines: `cluster=ray` with a
    `serve.host` beyond loopback), else any free loopback port for the run's own rollouts."""
    serve = config.serve
    remote_workers = config.cluster.kind == "ray" and serve.host not in LOOPBACK
    if live or serve.enabled or remote_workers:
        return serve
    return dataclasses.replace(serve, host="127.0.0.1", port=0)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _learner_and_engine(config: RunConfig, run_dir: Path) -> tuple[Learner, Engine]:
    """The learner and the engine serving the policy: the peft learner here and `engine=`,
    or with `backend=tinker` both on a Tinker service (`trainers.tinker_learner`)."""
    if config.backend.kind == "tinker":
        from trainers.tinker_learner import tinker_backend

        # a stand-in with the learner's interface for the loops (step, save_adapter,
        # save_checkpoint, load_checkpoint, version, step_count, trained_seqs)
        tinker_learner, tinker_engine = tinker_backend(config, run_dir)
        return cast(Learner, tinker_learner), tinker_engine
    learner = Learner(config.model.name, config.trainer, run_dir)
    return learner, _policy_engine(config, learner)


def _policy_engine(config: RunConfig, learner: Learner) -> Engine:
    """The engine that serves the policy: vLLM replicas on Ray (`cluster.replicas`), or the
    one `engine=` builds beside the learner (on a CPU, vLLM and the learner split the cores:
    vLLM pins its OpenMP threads, and the learner's must not spin on the same ones)."""
    if config.cluster.replicas:
        from trainers.cluster import ray_replicas

        if config.trainer.threads:
            torch.set_num_threads(config.trainer.threads)
        return ray_replicas(config.cluster, config.engine, config.model)
    engine_cpus = None
    if config.engine.backend == "vllm" and learner.device.type == "cpu":
        if config.trainer.overlap:
            learner_cpus, engine_cpus = split_cpus(own_cpus(), config.engine.threads)
        else:  # the phases alternate, never computing at once: each takes every core
            learner_cpus = engine_cpus = own_cpus()
        torch.set_num_threads(config.trainer.threads or len(learner_cpus))
        logger.info("cores: learner %s, vLLM %s", learner_cpus, engine_cpus)
    elif config.trainer.threads:
        torch.set_num_threads(config.trainer.threads)
    return build_engine(
        config.engine,
        config.model,
        shares_gpu_with_learner=learner.device.type == "cuda",
        cpus=engine_cpus,
    )


@contextlib.contextmanager
def cluster_session(config: RunConfig) -> Iterator[None]:
    """Connected to Ray for the run where `cluster=ray` has anything to place on it (rollout
    workers, replicas); nothing otherwise (Ray is not imported)."""
    simulated = any(env.users == "simulated" for env in config.env.values())
    if config.cluster.kind != "ray" or not (simulated or config.cluster.replicas):
        yield
        return
    from trainers.cluster import ray_cluster

    with ray_cluster(config.cluster):
        yield


@contextlib.contextmanager
def rollout_player(
    config: RunConfig,
    envs: Mapping[str, EnvConfig],
    url: str,
    admin_key: str,
    seat: ProxySeat,
) -> Iterator[EpisodePlayer]:
    """Where the run's episodes are played: threads of this process, or the rollout workers
    of a Ray cluster (`cluster=ray`, trainers/cluster.py; Ray is imported only then)."""
    if config.cluster.kind != "ray" or not envs:
        yield LocalPlayer(seat)
        return
    from trainers.cluster import RayPlayer, worker_url  # Ray is connected (cluster_session)

    key = serve_key(config.serve)
    player = RayPlayer(config.cluster, envs, worker_url(url, config.cluster), key, admin_key, seat)
    try:
        yield player
    finally:
        player.close()


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
