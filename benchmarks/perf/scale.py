"""Rollouts past one process: Terminal-v0 episodes/s played by 1, 2 and 4 Ray rollout
workers (`cluster=ray`, trainers/cluster.py) against the in-process rollout loop, in one
run; what Ray adds to an episode; and a projection of throughput on N nodes from the
measured per-episode costs.

    .venv/bin/python -m benchmarks.perf.scale [--workers 1 2 4] [--in-flight 4]
        [--seconds 60] [--warmup 15] [--commands 3] [--node-cores 16] [--nodes 1 4 16 64]

What is measured is the environment side of rollouts, not sampling: the policy behind the
real proxy is a scripted stand-in (`ScriptedBash`) that answers each turn at once with
`--commands` bash calls and then `submit`, rendered as `tiny`'s tokens (a 135M policy on
this CPU cannot call tools, and its decoding would hide what the workers cost). So each
episode starts (or reuses) a bwrap sandbox, runs the commands, and is graded as InterCode
grades it (the gold command in a fresh sandbox); every turn still crosses HTTP to the proxy
and is stored. Settings:

- in process: `trainers.rollouts.LocalPlayer`, `--in-flight` groups of 2 at a time, the
  trainer's threads playing;
- Ray xN: N workers (a Ray started here with N CPUs), the same groups in flight.

And, one group of one episode at a time, in process and on one Ray worker: the difference of
their seconds per episode is what a Ray round trip adds to an episode.

Figures: episodes/s in the window (and against in process), the trainer process's CPU
seconds per episode (proxy, store, loop: what stays on one node) and the rest of the
machine's (workers, sandboxes, graders: what spreads over the nodes). The projection takes
those: N nodes of `--node-cores` cores play at most N x cores / (rest CPU per episode)
episodes/s, and the one proxy at most 1 / (trainer CPU per episode) (one event loop), so
throughput is the smaller; sampling is left out (it scales with vLLM replicas).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from agents.compose import env_factory, serve_policy
from agents.config import EnvConfig, ModelConfig, ServeSection, serve_key
from agents.engines.base import Completion, SamplingParams
from agents.engines.embedded import EmbeddedEngine
from agents.seats import ProxySeat
from agents.store import Store
from agents.toolcalls import assistant_message
from benchmarks.perf.rollout import TimedProgress, machine_busy_s
from trainers.compute_config import ClusterConfig
from trainers.config import RolloutConfig, RunConfig
from trainers.rollouts import EnvSlot, EpisodePlayer, LocalPlayer, RolloutLoop

logger = logging.getLogger(__name__)

COMMANDS = (
    "cd /testbed 2>/dev/null; ls -la | head -20",
    "find . -maxdepth 2 -type f | head -30 | xargs -r wc -c | tail -1",
    "grep -rIl . . 2>/dev/null | head -5; echo done",
)


class ScriptedBash:
    """A stand-in for a policy that calls tools (see the module docstring): each reply is
    the next of `commands` as a `bash` call, then `submit`, as `tiny`'s tokens; the rest of
    the engine (encoding, adapters, closing) is the real embedded engine's."""

    def __init__(self, engine: EmbeddedEngine, commands: Sequence[str]):
        self.engine, self.commands = engine, list(commands)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = "policy",
    ) -> Completion:
        done = sum(m.get("role") == "assistant" for m in messages)
        call = (
            {"name": "bash", "arguments": {"command": self.commands[done]}}
            if done < len(self.commands)
            else {"name": "submit", "arguments": {}}
        )
        body = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        completion_ids = self.engine.tokenizer.encode(body) + [self.engine.tokenizer.eos_token_id]
        prompt_ids = self.engine.encode(messages, tools)
        return Completion(
            message=assistant_message(body, tools),
            prompt_token_ids=tuple(prompt_ids),
            completion_token_ids=tuple(completion_ids),
            completion_logprobs=tuple(0.0 for _ in completion_ids),
            finish_reason="tool_calls",
            policy_version=self.engine.policy_version,
            text=body,
            usage={"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion_ids)},
        )

    async def agenerate(self, *args: Any, **kwargs: Any) -> Completion:
        return self.generate(*args, **kwargs)


@dataclass(frozen=True)
class Measured:
    """One setting's figures over its window."""

    setting: str
    episodes: int
    seconds: float
    trainer_cpu_s: float
    rest_cpu_s: float

    @property
    def per_second(self) -> float:
        return self.episodes / self.seconds

    def per_episode(self, cpu_s: float) -> float:
        return cpu_s / max(self.episodes, 1)


def terminal_config(commands: int, group_size: int = 2) -> RunConfig:
    """Terminal-v0 on InterCode-ALFA in bwrap, turns enough for the script and its submit."""
    kwargs = {"tasks": "icalfa", "split": "train", "sandbox": "bwrap", "max_turns": commands + 1}
    terminal = EnvConfig(id="clawgym/Terminal-v0", kwargs=kwargs, group_size=group_size)
    return RunConfig(env={"terminal": terminal})


def measure(
    setting: str,
    player_of: Any,
    config: RunConfig,
    engine: ScriptedBash,
    scratch: Path,
    in_flight: int,
    warmup: float,
    seconds: float,
) -> Measured:
    """Plays for `warmup + seconds` with the player `player_of(url, admin_key, seat)` makes;
    the figures of the last `seconds`."""
    progress, stop = TimedProgress(), threading.Event()
    serve = ServeSection(port=0)
    slots = {name: EnvSlot(name, env, env_factory(env)) for name, env in config.env.items()}
    with (
        Store(scratch / f"store-{uuid.uuid4().hex}.sqlite") as store,
        serve_policy(engine, store, serve, ModelConfig("tiny")) as (url, proxy),
        contextlib.closing(ProxySeat(url, serve_key(serve), admin_key=proxy.admin_key)) as seat,
        contextlib.closing(player_of(url, proxy.admin_key, seat)) as player,
    ):
        rollout = RolloutConfig(groups_in_flight=in_flight)
        loop = RolloutLoop(rollout, slots, player, config.sampling, 0, progress, lambda: True)
        loop.start(store)
        runner = threading.Thread(target=loop.run, args=(stop,), daemon=True)
        runner.start()
        try:
            stop.wait(warmup)
            start, cpu, busy = time.time(), time.process_time(), machine_busy_s()
            stop.wait(seconds)
            end, cpu, busy = time.time(), time.process_time() - cpu, machine_busy_s() - busy
        finally:
            stop.set()
        runner.join()
        for slot in slots.values():
            slot.pool.close()
    episodes = len(progress.between(start, end))
    logger.info("%s: %d episodes in %.0f s", setting, episodes, end - start)
    return Measured(setting, episodes, end - start, cpu, max(busy - cpu, 0.0))


def local_player(url: str, admin_key: str, seat: ProxySeat) -> EpisodePlayer:
    return LocalPlayer(seat)


def ray_player(workers: int, config: RunConfig) -> Any:
    from trainers.cluster import RayPlayer

    def make(url: str, admin_key: str, seat: ProxySeat) -> EpisodePlayer:
        cluster = ClusterConfig(kind="ray", workers=workers, worker_cpus=1.0)
        return RayPlayer(cluster, config.env, url, None, admin_key, seat)

    return make


def table(rows: Sequence[Measured], serial: tuple[Measured, Measured]) -> Table:
    out = Table(title="Terminal-v0 rollouts (scripted policy, bwrap, InterCode grading)")
    columns = ("setting", "episodes/s", "x in process", "trainer CPU s/ep", "rest CPU s/ep")
    for column in columns:
        out.add_column(column, justify="left" if column == "setting" else "right")
    base = rows[0].per_second
    for row in rows:
        out.add_row(
            row.setting,
            f"{row.per_second:.2f}",
            f"{row.per_second / base:.2f}x",
            f"{row.per_episode(row.trainer_cpu_s):.3f}",
            f"{row.per_episode(row.rest_cpu_s):.3f}",
        )
    local, ray_one = serial
    added = 1 / ray_one.per_second - 1 / local.per_second
    out.caption = (
        f"one episode at a time: {1 / local.per_second:.3f} s in process, "
        f"{1 / ray_one.per_second:.3f} s on one Ray worker ({added * 1000:+.0f} ms an episode)"
    )
    return out


def projection(row: Measured, cores: int, nodes: Sequence[int]) -> Table:
    """Episodes/s on N nodes from the per-episode costs of `row`."""
    rest = row.per_episode(row.rest_cpu_s)
    proxy_limit = 1 / max(row.per_episode(row.trainer_cpu_s), 1e-9)
    out = Table(title=f"projection from {row.setting}: nodes of {cores} cores")
    for column in ("nodes", "workers' limit ep/s", "proxy's limit ep/s", "episodes/s"):
        out.add_column(column, justify="right")
    for count in nodes:
        workers_limit = count * cores / max(rest, 1e-9)
        out.add_row(
            str(count),
            f"{workers_limit:,.1f}",
            f"{proxy_limit:,.1f}",
            f"{min(workers_limit, proxy_limit):,.1f}",
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=15.0)
    parser.add_argument("--commands", type=int, default=3, choices=range(1, len(COMMANDS) + 1))
    parser.add_argument("--node-cores", type=int, default=16)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 16, 64])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    import ray

    config = terminal_config(args.commands)
    engine = ScriptedBash(EmbeddedEngine("tiny", threads=1), COMMANDS[: args.commands])
    ray.init(
        address="local",
        num_cpus=max(args.workers),
        include_dashboard=False,
        logging_level=logging.WARNING,
    )
    try:
        with tempfile.TemporaryDirectory() as scratch:
            timing = (Path(scratch), args.in_flight, args.warmup, args.seconds)
            rows = [measure("in process", local_player, config, engine, *timing)]
            for count in args.workers:
                player = ray_player(count, config)
                rows.append(measure(f"Ray x{count}", player, config, engine, *timing))
            one = (Path(scratch), 1, args.warmup / 2, args.seconds / 2)
            single = terminal_config(args.commands, group_size=1)
            serial = (
                measure("in process, 1 at a time", local_player, single, engine, *one),
                measure("Ray x1, 1 at a time", ray_player(1, single), single, engine, *one),
            )
    finally:
        ray.shutdown()
        engine.close()
    console = Console(width=140)
    console.print(table(rows, serial))
    best = max(rows[1:], key=lambda row: row.per_second)
    console.print(projection(best, args.node_cores, args.nodes))


if __name__ == "__main__":
    main()
