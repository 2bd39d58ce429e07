"""Rollout throughput: episodes/s, turns/s and completion tokens/s of a mixture of envs
played with 1, 4 and 8 task groups in flight, each against 1 in flight in the same run.

    .venv/bin/python -m benchmarks.perf.rollout [--engine embedded,vllm]
        [--models tiny,smollm2-135m] [--prefix-cache-tokens 0 16384]
        [--envs chat,arith,terminal] [--in-flight 1 4 8] [--seconds 60] [--warmup 10]
        [--rounds 1] [--max-tokens 16] [--max-batch 32] [--threads 1] [--vllm-cpus 0,1]
        [--seed 0] [--out FILE.json] [hydra overrides ...]

The rollout side of a training run, without the trainer: each of `--models` (default
`tiny`) served behind the real proxy (`agents.compose.serve_policy`, a free loopback port,
a store in a temporary directory), reached through a `ProxySeat`;
`trainers.rollouts.RolloutLoop` plays groups of the mixture with `has_room` always true.
`--engine` picks what serves the model, one or several, comma-separated (one after the
other, a table each):

- embedded (the default): transformers in this process, `--max-batch` rows decoded
  together on one worker thread with `--threads` torch threads, once per size of its
  prefix cache in `--prefix-cache-tokens` (`engine.prefix_cache_tokens`; 0 is off: the
  baseline, every prompt prefilled whole; default: the config's default alone);
- vllm: vLLM's OpenAI server from .venv-vllm (`agents.engines.vllm`; 20-70 s to start here,
  not counted), context 4096 tokens, with its prefix cache and continuous batching, and
  whole prefills only (`agents.engines.vllm_command._whole_prefill_args` says why). Its OpenMP
  threads are bound to `--vllm-cpus`, by default the cores `python -m trainers.run` gives
  vLLM beside a CPU learner (`agents.compose.split_cpus`: the last half; core 1 of 2).
  The proxy, the rollout loop, the sandboxes and vLLM's API server and scheduler run on any
  core. On 2 cores one OpenMP thread was faster than two at every setting (turns/s 13.2 /
  25.5 / 32.3 at 1 / 4 / 8 groups against 11.2 / 20.3 / 24.8 with `--vllm-cpus 0,1`,
  measured here; with `OMP_WAIT_POLICY=PASSIVE` two were no faster).

The envs are the `env` groups of agents/conf/env/, composed by Hydra as
`python -m trainers.run` composes them (extra arguments are more overrides, e.g.
`env.arith.group_size=8`), each turn capped at `--max-tokens`. The default mixture is chat
and arith, plus terminal (sandbox=bwrap) where a bwrap sandbox starts here.

The embedded engine gets one torch thread by default: on a 2-core machine two OpenMP
threads wait on each other whenever another thread or process holds a core (the proxy's,
the clients', a neighbour's): a 550-1000-token request on `tiny` took 0.2-3.8 s with 2
threads against 0.1-0.2 s with 1 while another process kept a core busy (measured here);
with `OMP_WAIT_POLICY=PASSIVE`, 2 threads were as fast as 1.

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
- CPU cores: this process's CPU seconds over the window, the vLLM server's (its process
  group, /proc), and the rest of the machine's (the sandboxes' shells and any other load;
  /proc/stat);
- embedded only: prompt tokens the prefix cache served a turn (their KV reused, not
  computed), over the window's prefills;
- vllm only, from its Prometheus /metrics over the window: engine steps/s, sequences
  decoded a step (generated tokens over steps: the batch continuous batching kept), tokens
  computed a step (those plus the prompt tokens prefilled), the server's CPU ms a step,
  and the share of prompt tokens its prefix cache served;
- `x`: the setting's rate over the first setting's (1 group in flight). Target (issue
  #21): >= 2.5x at 8.

With several engines, models or cache sizes, a last table sets their episodes/s side by
side, each over the first run of its model (the prefix cache off, if `0` comes first).
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

import httpx
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

import trainers
from agents.compose import build_engine, env_factory, serve_key, serve_policy, split_cpus
from agents.config import PREFIX_CACHE_TOKENS, ServeSection
from agents.engines.base import Engine
from agents.engines.embedded import EmbeddedEngine
from agents.engines.vllm import VLLMEngine
from agents.engines.vllm_command import own_cpus
from agents.engines.vllm_server import group_members
from agents.rollout import ProxySeat
from agents.store import Store
from envs.sandbox import SandboxError, make_sandbox
from envs.sandbox.bwrap import bwrap_available
from trainers.config import RunConfig, register_configs, validate
from trainers.progress import EpisodeRecord, Progress
from trainers.rollouts import EnvSlot, LocalPlayer, MakeEnv, RolloutLoop

logger = logging.getLogger(__name__)

TARGET = 2.5
"""Issue #21: episodes/s at 8 groups in flight over 1, at least."""
RATES = ("episodes_per_s", "turns_per_s", "tokens_per_s")
ENGINES = ("embedded", "vllm")
VLLM_CONTEXT = 4096
"""vllm's context length: the longest prompt here (terminal's tenth turn) is ~1000 tokens."""
VLLM_COUNTERS = {
    "steps": "vllm:iteration_tokens_total_count",
    "step_tokens": "vllm:iteration_tokens_total_sum",
    "generated": "vllm:generation_tokens_total",
    "prefix_queried": "vllm:prefix_cache_queries_total",
    "prefix_hits": "vllm:prefix_cache_hits_total",
}
"""The vLLM server's counters the benchmark reads (Prometheus names, summed over labels)."""


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

    engine: str
    model: str
    prefix_cache_tokens: int | None
    """embedded: the prefix cache's bound (0: off); None for vllm."""
    in_flight: int
    window_s: float
    episodes: int
    turns: int
    completion_tokens: int
    prompt_tokens: int
    """The window's turns' prompt tokens."""
    prefilled: tuple[int, int]
    """embedded: (prompt tokens, of them the prefix cache's) of the window's prefills;
    (0, 0) for vllm."""
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
    server: dict[str, float]
    """vllm: the server's CPU seconds (`cpu_s`) and `VLLM_COUNTERS` over the window; empty
    for the embedded engine (it computes in this process)."""

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
    def cached_per_turn(self) -> float:
        """Prompt tokens a turn whose KV the prefix cache gave (prefill saved)."""
        return self.prefilled[1] / self.turns if self.turns else 0.0

    @property
    def others_cpu_s(self) -> float:
        """CPU seconds the rest of the machine used: neither this process nor its server."""
        return self.machine_busy_s - self.cpu_s - self.server.get("cpu_s", 0.0)

    @property
    def mean_episode_s(self) -> float:
        return self.episode_wall_s / self.episodes if self.episodes else 0.0

    def plus(self, other: Measured) -> Measured:
        """Both windows' figures together (the same setting, another round)."""
        return Measured(
            engine=self.engine,
            model=self.model,
            prefix_cache_tokens=self.prefix_cache_tokens,
            in_flight=self.in_flight,
            window_s=self.window_s + other.window_s,
            episodes=self.episodes + other.episodes,
            turns=self.turns + other.turns,
            completion_tokens=self.completion_tokens + other.completion_tokens,
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            prefilled=(
                self.prefilled[0] + other.prefilled[0],
                self.prefilled[1] + other.prefilled[1],
            ),
            episode_wall_s=self.episode_wall_s + other.episode_wall_s,
            failed=self.failed + other.failed,
            by_env={k: self.by_env.get(k, 0) + other.by_env.get(k, 0) for k in self.by_env},
            envs_made=max(self.envs_made, other.envs_made),
            cpu_s=self.cpu_s + other.cpu_s,
            machine_busy_s=self.machine_busy_s + other.machine_busy_s,
            server={k: v + other.server.get(k, 0.0) for k, v in self.server.items()},
        )


def machine_busy_s() -> float:
    """CPU seconds the machine has spent busy since boot, all cores (/proc/stat)."""
    with open("/proc/stat") as stat:
        ticks = [int(value) for value in stat.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle and iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user and system) the live processes of process group `pgid` have used."""
    ticks = 0
    for pid in group_members(pgid):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:  # exited since it was listed
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def prometheus_sums(text: str, names: Sequence[str]) -> dict[str, float]:
    """Each metric of `names` in a Prometheus text exposition, summed over its label sets."""
    sums = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.split("{")[0].split()[0], line.rsplit(maxsplit=1)[-1]
        if name in sums:
            sums[name] += float(value)
    return sums


def server_sample(engine: Engine) -> dict[str, float]:
    """A vLLM engine's server: its process group's CPU seconds and `VLLM_COUNTERS` now;
    nothing for another engine."""
    if not isinstance(engine, VLLMEngine):
        return {}
    metrics = engine.base_url.removesuffix("/v1") + "/metrics"
    sums = prometheus_sums(httpx.get(metrics, timeout=30).text, list(VLLM_COUNTERS.values()))
    return {"cpu_s": group_cpu_s(engine.pid)} | {
        key: sums[name] for key, name in VLLM_COUNTERS.items()
    }


def prefill_counts(engine: Engine) -> tuple[int, int]:
    """The embedded engine's (prompt tokens prefilled, of them the prefix cache's) so far;
    (0, 0) for another engine."""
    return engine.prefill_counts() if isinstance(engine, EmbeddedEngine) else (0, 0)


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


def run_config(
    args: argparse.Namespace, engine: str, model: str, prefix_cache_tokens: int | None
) -> RunConfig:
    """The trainer's config composed for the benchmark: `model` on `engine` (embedded: with
    a prefix cache of `prefix_cache_tokens`), the chosen env groups, every turn capped at
    `--max-tokens`, then the extra overrides."""
    engine_overrides = {
        "embedded": [
            f"engine.threads={args.threads}",
            f"engine.max_batch={args.max_batch}",
            f"engine.prefix_cache_tokens={prefix_cache_tokens}",
        ],
        "vllm": [f"engine.context_length={VLLM_CONTEXT}"],
    }
    overrides = [
        f"model={model}",
        f"engine={engine}",
        *engine_overrides[engine],
        f"sampling.max_tokens={args.max_tokens}",
        f"seed={args.seed}",
        # rollouts alone: chat has no outcome for the main job's judge=env, and no warm start
        # or held-out evaluation belongs in a rollout's timing
        "judge=self",
        "sft.warm_start_steps=0",
        "eval.episodes=0",
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
            serve_policy(engine, store, serve, config.model.name) as (url, proxy),
            contextlib.closing(ProxySeat(url, serve_key(serve), admin_key=proxy.admin_key)) as seat,
            ThreadPoolExecutor(1, "rollout-loop") as runner,
        ):
            player = LocalPlayer(seat)
            loop = RolloutLoop(
                rollout, slots, player, config.sampling, config.seed, progress, lambda: True
            )
            loop.start(store)
            running = runner.submit(loop.run, stop)
            try:
                stop.wait(warmup)  # set early only by a worker's error, raised below
                start, cpu, busy = time.time(), time.process_time(), machine_busy_s()
                server, prefilled = server_sample(engine), prefill_counts(engine)
                stop.wait(seconds)
                end, cpu, busy = time.time(), time.process_time() - cpu, machine_busy_s() - busy
                server = {k: v - server[k] for k, v in server_sample(engine).items()}
                after = prefill_counts(engine)
                prefilled = (after[0] - prefilled[0], after[1] - prefilled[1])
            finally:
                stop.set()
            logger.info("%d in flight: window over, playing out the groups in flight", in_flight)
            running.result()
            turns = [turn for _, turn in store.turns() if start <= turn.created_at < end]
    finally:
        for slot in slots.values():
            slot.pool.close()
    episodes = progress.between(start, end)
    embedded = config.engine.backend == "embedded"
    return Measured(
        engine=config.engine.backend,
        model=config.model.name,
        prefix_cache_tokens=config.engine.prefix_cache_tokens if embedded else None,
        in_flight=in_flight,
        window_s=end - start,
        episodes=len(episodes),
        turns=len(turns),
        completion_tokens=sum(len(turn.completion_token_ids) for turn in turns),
        prompt_tokens=sum(len(turn.prompt_token_ids) for turn in turns),
        prefilled=prefilled,
        episode_wall_s=sum(e.wall_s for _, e in episodes),
        failed=sum(e.status == "failed" for _, e in episodes),
        by_env={name: sum(env == name for env, _ in episodes) for name in slots},
        envs_made=sum(slot.pool.made for slot in slots.values()),
        cpu_s=cpu,
        machine_busy_s=busy,
        server=server,
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
    if base.engine == "embedded":
        out.add_row(
            "prompt tokens from the prefix cache a turn",
            *(f"{row.cached_per_turn:.0f}" for row in rows),
        )
    out.add_row("CPU cores, this process", *(f"{row.cpu_s / row.window_s:.2f}" for row in rows))
    if base.server:
        out.add_row(
            "CPU cores, vLLM server", *(f"{row.server['cpu_s'] / row.window_s:.2f}" for row in rows)
        )
    out.add_row(
        "CPU cores, everything else", *(f"{row.others_cpu_s / row.window_s:.2f}" for row in rows)
    )
    out.add_row("env instances made (peak)", *(str(row.envs_made) for row in rows))
    out.add_row("failed episodes", *(str(row.failed) for row in rows))
    if base.server:
        add_server_rows(out, rows)
    return out


def add_server_rows(out: Table, rows: Sequence[Measured]) -> None:
    """The vLLM server's figures over each window (`VLLM_COUNTERS`)."""

    def per_step(row: Measured, value: float) -> str:
        return f"{value / row.server['steps']:.1f}" if row.server["steps"] else "-"

    out.add_row("vLLM engine steps/s", *(f"{r.server['steps'] / r.window_s:.1f}" for r in rows))
    out.add_row(
        "vLLM sequences decoded a step", *(per_step(r, r.server["generated"]) for r in rows)
    )
    out.add_row(
        "vLLM tokens computed a step", *(per_step(r, r.server["step_tokens"]) for r in rows)
    )
    out.add_row("vLLM server CPU ms a step", *(per_step(r, r.server["cpu_s"] * 1e3) for r in rows))
    out.add_row(
        "vLLM prefix cache hits (prompt tokens)",
        *(
            f"{r.server['prefix_hits'] / r.server['prefix_queried']:.0%}"
            if r.server["prefix_queried"]
            else "-"
            for r in rows
        ),
    )


def _rate(value: float, reference: float) -> str:
    return f"{value:.2f} ({value / reference:.2f}x)" if reference else f"{value:.2f} (-)"


def default_envs() -> list[str]:
    """chat and arith, and terminal where a bwrap sandbox starts here."""
    return ["chat", "arith", *(["terminal"] if bwrap_works() else [])]


@dataclass(frozen=True)
class EngineRun:
    """One engine's settings, measured."""

    config: RunConfig
    rows: list[Measured]
    startup_s: float
    """Seconds the engine took to build (the model loaded, vLLM's server answering)."""


def run(args: argparse.Namespace, config: RunConfig) -> EngineRun:
    """Every setting on `config`'s engine, in turn, `--rounds` times; each setting's rounds
    summed."""
    started = time.perf_counter()
    engine = make_engine(config, args.vllm_cpus)
    startup_s = time.perf_counter() - started
    logger.info("%s engine up in %.1f s", config.engine.backend, startup_s)
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
    return EngineRun(config, [totals[in_flight] for in_flight in args.in_flight], startup_s)


def make_engine(config: RunConfig, cpus: Sequence[int]) -> Engine:
    """The run's engine as `build_engine` makes it on a CPU (vLLM on `cpus`, prefilling
    whole prompts: `agents.engines.vllm_command._whole_prefill_args` says why)."""
    return build_engine(config.engine, config.model, cpus=cpus)


def engines_arg(value: str) -> list[str]:
    """`--engine`: one or several of `ENGINES`, comma-separated."""
    names = value.split(",")
    unknown = [name for name in names if name not in ENGINES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown engine {', '.join(unknown)}: choose from {', '.join(ENGINES)}"
        )
    return names


def cpus_arg(value: str) -> list[int]:
    """`--vllm-cpus`: core numbers, comma-separated."""
    return [int(cpu) for cpu in value.split(",")]


def caption(args: argparse.Namespace, result: EngineRun) -> str:
    """How the table was measured: the engine's settings, then the window's."""
    engine, cores = result.config.engine, len(os.sched_getaffinity(0))
    if engine.backend == "vllm":
        bound = ",".join(map(str, args.vllm_cpus))
        served = (
            "vLLM server (prefix caching, continuous batching, whole prefills), context "
            f"{engine.context_length}, {len(args.vllm_cpus)} OpenMP thread(s) bound to core(s) "
            f"{bound} of a {cores}-core machine, its other processes, this one and the "
            "sandboxes on any"
        )
    else:
        served = (
            f"{served_by(result)}, max_batch {engine.max_batch}, torch threads "
            f"{engine.threads} on a {cores}-core machine"
        )
    return (
        f"{served}, behind the proxy; up in {result.startup_s:.0f} s (not counted); "
        f"{args.max_tokens} tokens a turn; {args.rounds} x {args.seconds:.0f} s after "
        f"{args.warmup:.0f} s of warm-up, settings in turn; seed {args.seed}; "
        "x: over the first setting"
    )


def served_by(result: EngineRun) -> str:
    """The run's engine, and its prefix cache where it has one."""
    engine = result.config.engine
    if engine.backend != "embedded":
        return engine.backend
    cache = engine.prefix_cache_tokens
    return f"embedded, {cache}-token prefix cache" if cache else "embedded, no prefix cache"


def comparison(results: Sequence[EngineRun]) -> Table:
    """Every run's episodes/s and turns/s side by side, each over its model's first run at
    as many groups in flight, with the prompt tokens a turn its prefix cache served."""
    out = Table(title="each run over its model's first (x), by groups in flight")
    out.add_column("model")
    out.add_column("engine")
    for label in ("episodes/s", "turns/s"):
        for row in results[0].rows:
            out.add_column(f"{label} {row.in_flight}", justify="right")
    out.add_column("cached / prompt tokens a turn", justify="right")
    first: dict[str, EngineRun] = {}
    for result in results:
        base = first.setdefault(result.config.model.name, result)
        pairs = list(zip(result.rows, base.rows, strict=True))
        turns = sum(row.turns for row in result.rows) or 1
        cached = sum(row.prefilled[1] for row in result.rows) / turns
        prompts = sum(row.prompt_tokens for row in result.rows) / turns
        out.add_row(
            result.config.model.name,
            served_by(result),
            *(_rate(row.episodes_per_s, ref.episodes_per_s) for row, ref in pairs),
            *(_rate(row.turns_per_s, ref.turns_per_s) for row, ref in pairs),
            f"{cached:.0f} / {prompts:.0f}",
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--engine", type=engines_arg, default=["embedded"], help="embedded, vllm, or both"
    )
    parser.add_argument("--models", default="tiny", help="models, comma-separated")
    parser.add_argument(
        "--prefix-cache-tokens",
        type=int,
        nargs="+",
        default=[PREFIX_CACHE_TOKENS],
        help="embedded: one run per prefix-cache size (0: off)",
    )
    parser.add_argument("--envs", default=None, help="env groups, comma-separated")
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--seconds", type=float, default=60.0, help="measured window each")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before the window")
    parser.add_argument("--rounds", type=int, default=1, help="the settings played in turn")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per turn")
    parser.add_argument("--max-batch", type=int, default=32, help="engine.max_batch")
    parser.add_argument("--threads", type=int, default=1, help="embedded: torch threads")
    parser.add_argument(
        "--vllm-cpus", type=cpus_arg, default=None, help="vllm: its cores (default: a run's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the figures here")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides of the run config")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # a line per request, episode or sandbox shell: thousands a minute
    for chatty in ("httpx", "httpx2", "openai", "agents.rollout", "envs.sandbox"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    args.envs = args.envs.split(",") if args.envs else default_envs()
    args.vllm_cpus = args.vllm_cpus or split_cpus(own_cpus())[1]
    runs = [
        (engine, model, cache)
        for engine in args.engine
        for model in args.models.split(",")
        for cache in (args.prefix_cache_tokens if engine == "embedded" else [None])
    ]
    results = [run(args, run_config(args, *spec)) for spec in runs]
    for result in results:
        groups = ", ".join(f"{name} x{env.group_size}" for name, env in result.config.env.items())
        title = (
            f"rollout of {groups} on {result.config.model.name}, {served_by(result)} "
            f"(target: episodes/s >= {TARGET}x at 8 in flight)"
        )
        Console().print(table(result.rows, title, caption(args, result)))
    if len(results) > 1:
        Console().print(comparison(results))
    if args.out:
        write_figures(args, [row for result in results for row in result.rows])


def write_figures(args: argparse.Namespace, rows: Sequence[Measured]) -> None:
    """The settings and each setting's figures, as JSON at `args.out`."""
    figures = [{**asdict(row), **{rate: getattr(row, rate) for rate in RATES}} for row in rows]
    settings = {**vars(args), "out": str(args.out)}
    args.out.write_text(json.dumps({"settings": settings, "rows": figures}, indent=2) + "\n")
    logger.info("figures written to %s", args.out)


if __name__ == "__main__":
    main()
