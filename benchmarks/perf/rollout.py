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
import logging
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from rich.console import Console

import trainers
from agents.compose import build_engine, env_factory, serve_policy, split_cpus
from agents.config import PREFIX_CACHE_TOKENS, ServeSection, serve_key
from agents.engines.base import Engine
from agents.engines.embedded import EmbeddedEngine
from agents.engines.vllm import VLLMEngine
from agents.engines.vllm_command import own_cpus
from agents.engines.vllm_server import group_members
from agents.seats import ProxySeat
from agents.store import Store
from benchmarks.perf.rollout_report import (
    EngineRun,
    Measured,
    caption,
    comparison,
    served_by,
    table,
    write_figures,
)
from envs.sandbox import SandboxError, make_sandbox
from envs.sandbox.bwrap import bwrap_available
from trainers.config import RunConfig, register_configs, validate
from trainers.progress import EpisodeRecord, Progress
from trainers.rollouts import EnvSlot, LocalPlayer, MakeEnv, RolloutLoop

logger = logging.getLogger(__name__)

TARGET = 2.5
"""Issue #21: episodes/s at 8 groups in flight over 1, at least."""
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
    if not isinstance(engine, EmbeddedEngine):
        return 0, 0
    prompt, cached, _ = engine.prefill_counts()
    return prompt, cached


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
            serve_policy(engine, store, serve, config.model) as (url, proxy),
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
                window = sample_window(engine, stop, warmup, seconds)
            finally:
                stop.set()
            logger.info("%d in flight: window over, playing out the groups in flight", in_flight)
            running.result()
            turns = [t for _, t in store.turns() if window.start <= t.created_at < window.end]
    finally:
        for slot in slots.values():
            slot.pool.close()
    episodes = progress.between(window.start, window.end)
    embedded = config.engine.backend == "embedded"
    return Measured(
        engine=config.engine.backend,
        model=config.model.name,
        prefix_cache_tokens=config.engine.prefix_cache_tokens if embedded else None,
        in_flight=in_flight,
        window_s=window.end - window.start,
        episodes=len(episodes),
        turns=len(turns),
        completion_tokens=sum(len(turn.completion_token_ids) for turn in turns),
        prompt_tokens=sum(len(turn.prompt_token_ids) for turn in turns),
        prefilled=window.prefilled,
        episode_wall_s=sum(e.wall_s for _, e in episodes),
        failed=sum(e.status == "failed" for _, e in episodes),
        by_env={name: sum(env == name for env, _ in episodes) for name in slots},
        envs_made=sum(slot.pool.made for slot in slots.values()),
        cpu_s=window.cpu_s,
        machine_busy_s=window.busy_s,
        server=window.server,
    )


@dataclass(frozen=True)
class Window:
    """What the measured window saw of the clock, the CPUs, the server and the prefills."""

    start: float
    end: float
    cpu_s: float
    busy_s: float
    server: dict[str, float]
    prefilled: tuple[int, int]


def sample_window(engine: Engine, stop: threading.Event, warmup: float, seconds: float) -> Window:
    """Waits out the warm-up, then samples the counters across the next `seconds` (`stop`
    is set early only by a worker's error, which the caller raises)."""
    stop.wait(warmup)
    start, cpu, busy = time.time(), time.process_time(), machine_busy_s()
    server, prefilled = server_sample(engine), prefill_counts(engine)
    stop.wait(seconds)
    end, cpu, busy = time.time(), time.process_time() - cpu, machine_busy_s() - busy
    server = {k: v - server[k] for k, v in server_sample(engine).items()}
    after = prefill_counts(engine)
    return Window(start, end, cpu, busy, server, (after[0] - prefilled[0], after[1] - prefilled[1]))


def default_envs() -> list[str]:
    """chat and arith, and terminal where a bwrap sandbox starts here."""
    return ["chat", "arith", *(["terminal"] if bwrap_works() else [])]


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


if __name__ == "__main__":
    main()
