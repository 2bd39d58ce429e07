"""Rollout throughput: episodes/s, turns/s and completion tokens/s of a mixture of envs
played with 1, 4 and 8 task groups in flight, each against 1 in flight in the same run.

    .venv/bin/python -m benchmarks.perf.rollout [--envs chat,arith,terminal]
        [--in-flight 1 4 8] [--seconds 60] [--warmup 10] [--rounds 1] [--max-tokens 16]
        [--max-batch 32] [--threads 1] [--seed 0] [--out FILE.json] [hydra overrides ...]

The rollout side of a training run, without the trainer: the `tiny` model on the embedded
engine (`--max-batch` rows decoded together, `--threads` torch threads) served behind the
real proxy (`agents.compose.serve_policy`, a free loopback port, a store in a temporary
directory), reached through a `ProxySeat`; `trainers.rollouts.RolloutLoop` plays groups of
the mixture with `has_room` always true. The envs are the `env` groups of agents/conf/env/,
composed by Hydra as `python -m trainers.run` composes them (extra arguments are more
overrides, e.g. `env.arith.group_size=8`), each turn capped at `--max-tokens`. The default
mixture is chat and arith, plus terminal (sandbox=bwrap) where a bwrap sandbox starts here.

One torch thread by default: on a 2-core machine two OpenMP threads wait on each other
whenever another thread or process holds a core (the proxy's, the clients', a neighbour's):
a 550-1000-token request on `tiny` took 0.2-3.8 s with 2 threads against 0.1-0.2 s with 1
while another process kept a core busy (measured here); with `OMP_WAIT_POLICY=PASSIVE`,
2 threads were as fast as 1.

Each setting gets a fresh store, proxy, seat and env pools and the same seed. It plays for
`--warmup` seconds (pools filling, the first groups' lock-step start), then for the
`--seconds` window the figures count; then the loop's stop event is set and the groups in
flight are played out, uncounted (fewer and fewer groups are in flight then). With
`--rounds` above 1 the settings take turns that many times and each one's windows are
summed, so that a load that comes and goes on a shared machine falls on all of them.

- episodes/s: episodes that ended in the window (the loop's `Progress` records); a
  setting with more groups in flight holds more long episodes (terminal's ten turns) open,
  so turns/s is the steadier figure;
- turns/s, completion tokens/s, prompt tokens a turn: policy turns the proxy committed in
  the window (the store's turns, by their commit time);
- CPU cores: this process's CPU seconds over the window, and the rest of the machine's
  (the sandboxes' shells and any other load; /proc/stat);
- `x`: the setting's rate over the first setting's (1 group in flight). Target (issue
  #21): >= 2.5x at 8.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

import trainers
from agents.compose import build_engine, env_factory, serve_key, serve_policy
from agents.config import ServeSection
from agents.engines.base import Engine
from agents.rollout import ProxySeat
from agents.store import Store
from envs.sandbox import SandboxError, make_sandbox
from envs.sandbox.bwrap import bwrap_available
from trainers.config import RunConfig, register_configs, validate
from trainers.progress import EpisodeRecord, Progress
from trainers.rollouts import EnvSlot, MakeEnv, RolloutLoop

logger = logging.getLogger(__name__)

TARGET = 2.5
"""Issue #21: episodes/s at 8 groups in flight over 1, at least."""
RATES = ("episodes_per_s", "turns_per_s", "tokens_per_s")


@dataclass
class TimedProgress(Progress):
    """A run's counters, with when each episode ended (the benchmark's window)."""

    ended: list[tuple[float, str, EpisodeRecord]] = field(default_factory=list)
    """(`time.time()`, env, record) of each episode, as it was recorded."""

    def record(self, env: str, episode: EpisodeRecord) -> None:
        super().record(env, episode)
        self.ended.append((time.time(), env, episode))

    def between(self, start: float, end: float) -> list[tuple[str, EpisodeRecord]]:
        """(env, record) of the episodes that ended in [start, end)."""
        return [(env, record) for at, env, record in self.ended if start <= at < end]


@dataclass(frozen=True)
class Measured:
    """One setting's figures over its windows (summed over rounds)."""

    in_flight: int
    window_s: float
    episodes: int
    turns: int
    completion_tokens: int
    prompt_tokens: int
    """The window's turns' prompt tokens: what the engine prefilled for them."""
    episode_wall_s: float
    """The window's episodes' wall times, summed."""
    failed: int
    """Episodes of the window that ended failed (a refused turn, a broken env)."""
    by_env: dict[str, int]
    """Episodes of the window, per env."""
    envs_made: int
    """Env instances the pools made: per env, the most of its episodes ever in flight."""
    cpu_s: float
    """CPU seconds this process used in the window (every thread)."""
    machine_busy_s: float
    """CPU seconds the whole machine used in the window (this process, its sandboxes'
    shells, and whatever else runs here)."""

    @property
    def episodes_per_s(self) -> float:
        return self.episodes / self.window_s

    @property
    def turns_per_s(self) -> float:
        return self.turns / self.window_s

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.window_s

    @property
    def mean_episode_s(self) -> float:
        return self.episode_wall_s / self.episodes if self.episodes else 0.0

    def plus(self, other: Measured) -> Measured:
        """Both windows' figures together (the same setting, another round)."""
        return Measured(
            in_flight=self.in_flight,
            window_s=self.window_s + other.window_s,
            episodes=self.episodes + other.episodes,
            turns=self.turns + other.turns,
            completion_tokens=self.completion_tokens + other.completion_tokens,
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            episode_wall_s=self.episode_wall_s + other.episode_wall_s,
            failed=self.failed + other.failed,
            by_env={k: self.by_env.get(k, 0) + other.by_env.get(k, 0) for k in self.by_env},
            envs_made=max(self.envs_made, other.envs_made),
            cpu_s=self.cpu_s + other.cpu_s,
            machine_busy_s=self.machine_busy_s + other.machine_busy_s,
        )


def machine_busy_s() -> float:
    """CPU seconds the machine has spent busy since boot, all cores (/proc/stat)."""
    with open("/proc/stat") as stat:
        ticks = [int(value) for value in stat.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle and iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def bwrap_works() -> bool:
    """Whether a bwrap sandbox starts and runs a command here (user namespaces on)."""
    if not bwrap_available():
        return False
    try:
        sandbox = make_sandbox("bwrap")
        try:
            return sandbox.exec("true").exit_code == 0
        finally:
            sandbox.close()
    except (SandboxError, OSError) as error:
        logger.info("no terminal env: a bwrap sandbox does not start here (%s)", error)
        return False


def run_config(args: argparse.Namespace) -> RunConfig:
    """The trainer's config composed for the benchmark: the tiny model on the embedded
    engine, the chosen env groups, every turn capped at `--max-tokens`, then the extra
    overrides."""
    overrides = [
        "model=tiny",
        "engine=embedded",
        f"engine.threads={args.threads}",
        f"engine.max_batch={args.max_batch}",
        f"sampling.max_tokens={args.max_tokens}",
        f"seed={args.seed}",
        f"env=[{','.join(args.envs)}]",
        *(f"env.{name}.max_tokens={args.max_tokens}" for name in args.envs),
        *(["env.terminal.kwargs.sandbox=bwrap"] if "terminal" in args.envs else []),
        *args.overrides,
    ]
    register_configs()
    with initialize_config_dir(str(Path(trainers.__file__).parent / "conf"), version_base=None):
        config: RunConfig = OmegaConf.to_object(compose("config", overrides=overrides))  # type: ignore[assignment]
    validate(config)
    return config


def measure(
    in_flight: int,
    config: RunConfig,
    engine: Engine,
    make_envs: Mapping[str, MakeEnv],
    warmup: float,
    seconds: float,
    scratch: Path,
) -> Measured:
    """Plays the mixture with `in_flight` groups at a time for `warmup + seconds`, fresh
    store, proxy and pools; returns the figures of the last `seconds`."""
    rollout = dataclasses.replace(config.rollout, groups_in_flight=in_flight)
    slots = {name: EnvSlot(name, config.env[name], make) for name, make in make_envs.items()}
    progress, stop, serve = TimedProgress(), threading.Event(), ServeSection(port=0)
    try:
        with (
            Store(scratch / f"store-{uuid.uuid4().hex}.sqlite") as store,
            serve_policy(engine, store, serve, config.model.name) as (url, _),
            contextlib.closing(ProxySeat(url, serve_key(serve))) as seat,
            ThreadPoolExecutor(1, "rollout-loop") as runner,
        ):
            loop = RolloutLoop(
                rollout, slots, seat, config.sampling, config.seed, progress, has_room=lambda: True
            )
            loop.start(store)
            running = runner.submit(loop.run, stop)
            try:
                stop.wait(warmup)  # set early only by a worker's error, raised below
                start, cpu, busy = time.time(), time.process_time(), machine_busy_s()
                stop.wait(seconds)
                end, cpu, busy = time.time(), time.process_time() - cpu, machine_busy_s() - busy
            finally:
                stop.set()
            logger.info("%d in flight: window over, playing out the groups in flight", in_flight)
            running.result()
            turns = [turn for _, turn in store.turns() if start <= turn.created_at < end]
    finally:
        for slot in slots.values():
            slot.pool.close()
    episodes = progress.between(start, end)
    return Measured(
        in_flight=in_flight,
        window_s=end - start,
        episodes=len(episodes),
        turns=len(turns),
        completion_tokens=sum(len(turn.completion_token_ids) for turn in turns),
        prompt_tokens=sum(len(turn.prompt_token_ids) for turn in turns),
        episode_wall_s=sum(e.wall_s for _, e in episodes),
        failed=sum(e.status == "failed" for _, e in episodes),
        by_env={name: sum(env == name for env, _ in episodes) for name in slots},
        envs_made=sum(slot.pool.made for slot in slots.values()),
        cpu_s=cpu,
        machine_busy_s=busy,
    )


def table(rows: Sequence[Measured], title: str, caption: str) -> Table:
    """One column per setting; each rate with its ratio over the first column's."""
    out = Table(title=title, caption=caption)
    out.add_column("groups in flight")
    for row in rows:
        out.add_column(str(row.in_flight), justify="right")
    base = rows[0]
    for label, rate in zip(("episodes/s", "turns/s", "completion tokens/s"), RATES, strict=True):
        out.add_row(label, *(_rate(getattr(row, rate), getattr(base, rate)) for row in rows))
    out.add_row("episodes / turns", *(f"{row.episodes} / {row.turns}" for row in rows))
    out.add_row("episode wall s (mean)", *(f"{row.mean_episode_s:.2f}" for row in rows))
    out.add_row(
        "prompt tokens a turn (mean)",
        *(f"{row.prompt_tokens / row.turns:.0f}" if row.turns else "-" for row in rows),
    )
    out.add_row("CPU cores, this process", *(f"{row.cpu_s / row.window_s:.2f}" for row in rows))
    out.add_row(
        "CPU cores, everything else",
        *(f"{(row.machine_busy_s - row.cpu_s) / row.window_s:.2f}" for row in rows),
    )
    out.add_row("env instances made (peak)", *(str(row.envs_made) for row in rows))
    out.add_row("failed episodes", *(str(row.failed) for row in rows))
    return out


def _rate(value: float, reference: float) -> str:
    return f"{value:.2f} ({value / reference:.2f}x)" if reference else f"{value:.2f} (-)"


def default_envs() -> list[str]:
    """chat and arith, and terminal where a bwrap sandbox starts here."""
    return ["chat", "arith", *(["terminal"] if bwrap_works() else [])]


def run(args: argparse.Namespace, config: RunConfig) -> list[Measured]:
    """Every setting, in turn, `--rounds` times; each setting's rounds summed."""
    engine = build_engine(config.engine, config.model)
    make_envs = {name: env_factory(env) for name, env in config.env.items()}
    totals: dict[int, Measured] = {}
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for number in range(args.rounds):
                for in_flight in args.in_flight:
                    logger.info("round %d: %d group(s) in flight", number + 1, in_flight)
                    measured = measure(
                        in_flight,
                        config,
                        engine,
                        make_envs,
                        args.warmup,
                        args.seconds,
                        Path(scratch),
                    )
                    logger.info("%s", measured)
                    done = totals.get(in_flight)
                    totals[in_flight] = done.plus(measured) if done else measured
    finally:
        engine.close()
    return [totals[in_flight] for in_flight in args.in_flight]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--envs", default=None, help="env groups, comma-separated")
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--seconds", type=float, default=60.0, help="measured window each")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before the window")
    parser.add_argument("--rounds", type=int, default=1, help="the settings played in turn")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per turn")
    parser.add_argument("--max-batch", type=int, default=32, help="engine.max_batch")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the figures here")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides of the run config")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # a line per request, episode or sandbox shell: thousands a minute
    for chatty in ("httpx", "httpx2", "openai", "agents.rollout", "envs.sandbox"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    args.envs = args.envs.split(",") if args.envs else default_envs()
    config = run_config(args)
    rows = run(args, config)
    groups = ", ".join(f"{name} x{env.group_size}" for name, env in config.env.items())
    title = f"rollout of {groups} on tiny (target: episodes/s >= {TARGET}x at 8 in flight)"
    caption = (
        f"embedded engine, max_batch {config.engine.max_batch}, torch threads "
        f"{config.engine.threads} on a {len(os.sched_getaffinity(0))}-core machine, behind "
        "the proxy; "
        f"{args.max_tokens} tokens a turn; {args.rounds} x {args.seconds:.0f} s after "
        f"{args.warmup:.0f} s of warm-up, settings in turn; seed {args.seed}; "
        "x: over the first setting"
    )
    Console().print(table(rows, title, caption))
    if args.out:
        write_figures(args, rows)


def write_figures(args: argparse.Namespace, rows: Sequence[Measured]) -> None:
    """The settings and each setting's figures, as JSON at `args.out`."""
    figures = [{**asdict(row), **{rate: getattr(row, rate) for rate in RATES}} for row in rows]
    settings = {**vars(args), "out": str(args.out)}
    args.out.write_text(json.dumps({"settings": settings, "rows": figures}, indent=2) + "\n")
    logger.info("figures written to %s", args.out)


if __name__ == "__main__":
    main()
