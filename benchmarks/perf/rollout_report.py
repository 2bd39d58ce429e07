"""The rollout benchmark's figures (`benchmarks.perf.rollout`): each setting's `Measured`
record, and the tables and JSON it prints them as.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from rich.table import Table

from trainers.config import RunConfig

logger = logging.getLogger(__name__)

RATES = ("episodes_per_s", "turns_per_s", "tokens_per_s")


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
    """vllm: the server's CPU seconds (`cpu_s`) and `rollout.VLLM_COUNTERS` over the window; empty
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


@dataclass(frozen=True)
class EngineRun:
    """One engine's settings, measured."""

    config: RunConfig
    rows: list[Measured]
    startup_s: float
    """Seconds the engine took to build (the model loaded, vLLM's server answering)."""


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
    """The vLLM server's figures over each window (`rollout.VLLM_COUNTERS`)."""

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


def write_figures(args: argparse.Namespace, rows: Sequence[Measured]) -> None:
    """The settings and each setting's figures, as JSON at `args.out`."""
    figures = [{**asdict(row), **{rate: getattr(row, rate) for rate in RATES}} for row in rows]
    settings = {**vars(args), "out": str(args.out)}
    args.out.write_text(json.dumps({"settings": settings, "rows": figures}, indent=2) + "\n")
    logger.info("figures written to %s", args.out)
