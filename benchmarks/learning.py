"""Does the policy learn? Each method's held-out preference score before and after training
on the personal-agent environment, and the speed-up of overlapping the loops.

    python -m benchmarks.learning [--model smollm2-135m] [--steps 16] [--persona brief]
        [--methods binary opd combine] [--judge feedback] [--lr 5e-4] [--eval-tasks 20]
        [--eval-max-tokens 128] [--speedup-steps 4] [--out DIR]

Preference score: the persona's programmatic check (evaluation only, never a reward) of the
policy's first reply on held-out tasks, greedy, as OpenClaw-RL's "personalisation score",
with a reply budget long enough that the budget never makes a reply look brief. Beside it,
the share of replies on topic (`envs.chat.personas.on_topic`) and the score with off-topic
replies counted as 0: a policy can meet "be brief" by saying nothing.
Speed-up: wall time for the same number of steps with rollout, judging and training
overlapped (the rollout one batch ahead), against strictly alternating them at the same
torch threads and at every core. Prints two tables and writes learning.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
from rich.console import Console
from rich.table import Table

import envs  # noqa: F401  (registers the clawgym/ environments)
from agents.config import EnvConfig
from agents.engines.base import POLICY, SamplingParams
from agents.engines.embedded import EmbeddedEngine
from trainers.config import RunConfig
from trainers.metrics import read_metrics
from trainers.run import train

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldOut:
    """First replies to held-out tasks, scored."""

    score: float
    """Mean preference score."""
    on_topic: float
    """Share of replies that share a topic word with their question."""
    guarded: float
    """Mean preference score counting off-topic replies as 0: what a reply that says
    nothing cannot game."""


def held_out_score(engine: EmbeddedEngine, persona: str, tasks: int, max_tokens: int) -> HeldOut:
    """First-reply scores on held-out chat tasks, greedy, decoded as one batch.

    `max_tokens` should let an unconstrained reply run past the point where the check stops
    rewarding it: a reply cut short by the budget would look briefer than the policy is.
    """
    chats = []
    observations = []
    for seed in range(tasks):  # the same seeds, so the same words, each time
        env = gym.make("clawgym/Chat-v0", split="test", persona=persona, questions_per_episode=1)
        task_id = list(env.unwrapped.task_ids())[seed]  # type: ignore[attr-defined]
        observation, _ = env.reset(seed=seed, options={"task_id": task_id})
        chats.append(env)
        observations.append(observation)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    with ThreadPoolExecutor(len(observations)) as pool:
        replies = list(
            pool.map(lambda obs: engine.generate(obs, None, greedy, POLICY), observations)
        )
    scores, topical = [], []
    for env, reply in zip(chats, replies, strict=True):
        _, _, _, _, info = env.step(dict(reply.message))
        scores.append(float(info["first_reply_score"]))
        topical.append(bool(info["first_reply_on_topic"]))
        env.close()
    return HeldOut(
        score=sum(scores) / len(scores),
        on_topic=sum(topical) / len(topical),
        guarded=sum(s for s, t in zip(scores, topical, strict=True) if t) / len(scores),
    )


def run_config(
    args: argparse.Namespace, method: str, steps: int, overlap: bool, threads: int | None = None
) -> RunConfig:
    config = RunConfig()
    config.model.name = args.model
    config.method.name = method
    config.env = {
        "chat": EnvConfig(
            id="clawgym/Chat-v0",
            kwargs={"split": "train", "persona": args.persona, "questions_per_episode": 2},
            outcome_weight=0.0,
            group_size=args.group_size,
        )
    }
    config.engine.threads = threads or args.threads
    config.trainer.max_steps = steps
    config.trainer.batch_turns = args.batch_turns
    config.trainer.overlap = overlap
    config.trainer.lr = args.lr
    config.sampling.max_tokens = args.max_tokens
    config.judge.kind = args.judge
    config.judge.max_tokens = 48
    return config


def learn(
    args: argparse.Namespace, method: str, before: HeldOut, trained: dict[str, Any] | None
) -> dict[str, Any]:
    """Trains one method and scores the trained policy (`before` is the base model's).
    With `trained` (the method's earlier result) the run in `--out` is only scored again."""
    run_dir = args.out / method
    if trained is None:
        summary = train(run_config(args, method, args.steps, overlap=True), run_dir)
        trained = {"steps": summary.steps, "wall_s": summary.wall_s}
    version = max(int(p.name[1:]) for p in (run_dir / "adapters").glob("v*"))
    engine = EmbeddedEngine(args.model, threads=args.threads)
    engine.load_adapter(str(run_dir / "adapters" / f"v{version}"), version)
    after = held_out_score(engine, args.persona, args.eval_tasks, args.eval_max_tokens)
    engine.close()
    rewards = [row.get("judge_score") for row in read_metrics(run_dir) if "env" not in row]
    return {
        "method": method,
        "before": before.score,
        "after": after.score,
        "on_topic_before": before.on_topic,
        "on_topic_after": after.on_topic,
        "guarded_before": before.guarded,
        "guarded_after": after.guarded,
        "steps": trained["steps"],
        "wall_s": trained["wall_s"],
        "curve": rewards,
    }


def base_score(args: argparse.Namespace) -> HeldOut:
    engine = EmbeddedEngine(args.model, threads=args.threads)
    try:
        return held_out_score(engine, args.persona, args.eval_tasks, args.eval_max_tokens)
    finally:
        engine.close()


def after_first_step(run_dir: Path) -> float:
    """Seconds from the first adapter to the last: the steady state, once the first batch
    (which has nothing to overlap with) has been played."""
    written = sorted(p.stat().st_mtime for p in (run_dir / "adapters").glob("v*"))
    return written[-1] - written[0]


def speedup(args: argparse.Namespace) -> list[tuple[str, int, float, float]]:
    """Wall seconds for `speedup_steps` binary steps, and those after the first step:
    overlapped, then strictly alternating at the same torch threads, and alternating with
    every core (each phase then has the whole machine, the strongest sequential baseline)."""
    cases = [(True, args.threads), (False, args.threads)]
    cores = os.cpu_count() or 1
    if cores != args.threads:
        cases.append((False, cores))
    walls = []
    for overlap, threads in cases:
        loops = "overlapped" if overlap else "alternating"
        config = run_config(args, "binary", args.speedup_steps, overlap, threads)
        started = time.monotonic()
        run_dir = args.out / f"speedup-{loops}-{threads}"
        train(config, run_dir)
        walls.append((loops, threads, time.monotonic() - started, after_first_step(run_dir)))
    return walls


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (bars, curves) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["method"] for r in results]
    positions = range(len(results))
    width = 0.27
    bars.bar([p - width for p in positions], [r["before"] for r in results], width, label="before")
    bars.bar(positions, [r["after"] for r in results], width, label="after")
    bars.bar(
        [p + width for p in positions],
        [r["guarded_after"] for r in results],
        width,
        label="after, off-topic replies as 0",
    )
    bars.set_xticks(list(positions), names)
    bars.set_ylim(0, 1)
    bars.set_ylabel("held-out preference score")
    bars.legend()
    for result in results:
        curves.plot(
            range(1, len(result["curve"]) + 1), result["curve"], marker="o", label=result["method"]
        )
    curves.set_xlabel("step")
    curves.set_ylabel("mean judge score of the step's turns")
    curves.set_title("training")
    curves.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch-turns", type=int, default=8)
    parser.add_argument("--persona", default="brief")
    parser.add_argument(
        "--methods", nargs="*", default=["binary", "opd", "combine"], help="none: speed-up only"
    )
    parser.add_argument(
        "--judge",
        default="feedback",
        help="judge kind (trainers/judge.py); the 135M self-judge reads feedback poorly",
    )
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; at 1 the overlapped rollout and training each keep a core busy",
    )
    parser.add_argument(
        "--group-size", type=int, default=4, help="rollouts per task, decoded as one batch"
    )
    parser.add_argument("--max-tokens", type=int, default=48, help="training reply budget")
    parser.add_argument(
        "--eval-max-tokens",
        type=int,
        default=128,
        help="reply budget when scoring; past 75 words a brief reply already scores 0",
    )
    parser.add_argument("--eval-tasks", type=int, default=20)
    parser.add_argument("--speedup-steps", type=int, default=4)
    parser.add_argument(
        "--rescore", action="store_true", help="score the runs already in --out, no training"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/benchmark-learning"))
    return parser.parse_args()


def learning_table(args: argparse.Namespace, results: list[dict[str, Any]]) -> Table:
    table = Table(
        title=f"learning on Chat-v0 ({args.persona}), {args.model}, judge={args.judge}, "
        f"lr {args.lr:g}, {args.steps} steps of {args.batch_turns} turns"
    )
    columns = ("method", "score before", "score after", "change", "on-topic before / after")
    for column in (*columns, "guarded before / after", "train wall s"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for r in results:
        table.add_row(
            r["method"],
            f"{r['before']:.3f}",
            f"{r['after']:.3f}",
            f"{r['after'] - r['before']:+.3f}",
            f"{r['on_topic_before']:.2f} / {r['on_topic_after']:.2f}",
            f"{r['guarded_before']:.3f} / {r['guarded_after']:.3f}",
            f"{r['wall_s']:.0f}",
        )
    return table


def speedup_table(args: argparse.Namespace, walls: list[tuple[str, int, float, float]]) -> Table:
    table = Table(title=f"async speed-up: {args.speedup_steps} binary steps, same turns")
    timed = ("loops", "torch threads", "wall s", "overlapped speed-up")
    for column in (*timed, "after step 1 s", "speed-up after step 1"):
        table.add_column(column, justify="left" if column == "loops" else "right")
    _, _, overlapped, steady = walls[0]
    for loops, threads, wall, after in walls:
        table.add_row(
            loops,
            str(threads),
            f"{wall:.0f}",
            f"{wall / overlapped:.2f}x",
            f"{after:.0f}",
            f"{after / steady:.2f}x",
        )
    return table


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    before = base_score(args) if args.methods else HeldOut(0.0, 0.0, 0.0)
    earlier = {}
    if args.rescore:
        earlier = {r["method"]: r for r in json.loads((args.out / "learning.json").read_text())}
    for method in args.methods:  # each result is kept as soon as it exists
        results.append(learn(args, method, before, earlier.get(method)))
        (args.out / "learning.json").write_text(json.dumps(results, indent=2))
    console = Console()
    console.print(learning_table(args, results))
    if args.speedup_steps:
        console.print(speedup_table(args, speedup(args)))
    if results:
        plot(results, args.out / "learning.png")
    (args.out / "learning.json").write_text(json.dumps(results, indent=2))
    console.print(f"plot: {args.out / 'learning.png'}")


if __name__ == "__main__":
    main()
