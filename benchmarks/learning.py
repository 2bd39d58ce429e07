"""Does the policy learn, and which method learns best? Each method's held-out preference
score on the personal-agent environment (Chat-v0) at every few steps, over several seeds,
with its 95% interval, its paired difference from the first method, and the policy's entropy
and KL to its start by step, as one table (`benchmarks.learning_report`); and the speed-up of
overlapping the loops.

    python -m benchmarks.learning [--model smollm2-135m] [--steps 16] [--persona brief|all]
        [--methods combine topk_combine oel] [--seeds 0 1] [--eval-every 4] [--judge feedback]
        [--hint-selection overlap] [--lr 5e-4] [--eval-tasks 20] [--eval-max-tokens 128]
        [--experience-max-tokens 256] [--speedup-steps 4] [--out DIR]

The default compares OpenClaw-RL's methods: `combine` (clawgym's OPD + binary RL), its
top-k form `topk_combine` (hints chosen by `--hint-selection`, overlap by default) and
experience distillation `oel`, each with `judge=feedback`, the same steps, batch and seeds.
Every (method, seed) is an ordinary training run under `--out/<method>/seed-<N>` whose
adapters `v<N>` are scored after it: a run that reached its steps is not trained again, and
one scored at the same steps already (its `benchmark.json`) is not scored again; delete that
file to rescore.

Preference score: the persona's programmatic check (the ground truth, evaluation only, never
a reward) of the policy's first reply on held-out tasks, greedy, as OpenClaw-RL's
"personalisation score", with a reply budget long enough that the budget never makes a reply
look brief. Beside it, the share of replies on topic (`envs.chat.personas.on_topic`) and the
score with off-topic replies counted as 0: a policy can meet "be brief" by saying nothing.
`--persona all` trains and scores on every persona's tasks (held-out tasks evenly spaced over
them).
Speed-up: wall time for the same number of steps with rollout, judging and training
overlapped (the rollout one batch ahead), against strictly alternating them at the same
torch threads and at every core. Prints the tables and writes learning.png and
learning.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

import envs  # noqa: F401  (registers the clawgym/ environments)
from agents.config import EnvConfig
from agents.engines.base import BASE, POLICY, SamplingParams
from agents.engines.embedded import EmbeddedEngine
from benchmarks.learning_report import comparison_table, plot, step_scores
from trainers.config import MethodConfig, RunConfig
from trainers.evaluation import evenly_spaced
from trainers.metrics import read_metrics, step_rows
from trainers.run import train

logger = logging.getLogger(__name__)

METHOD_CONFIGS = Path(__file__).resolve().parents[1] / "trainers" / "conf" / "method"
"""The `method=` group of `trainers.run`: each method's settings."""

TRAINING_KEYS = ("entropy", "kl_to_start", "judge_score", "distill_tokens", "loss")
"""What a run record keeps of each step's row of metrics.jsonl."""


@dataclass(frozen=True)
class HeldOut:
    """First replies to held-out tasks, scored: one value per task, in task order."""

    scores: tuple[float, ...]
    """Each reply's preference score."""
    on_topic: tuple[bool, ...]
    """Whether each reply shares a topic word with its question."""


def held_out_tasks(persona: str | None, count: int) -> list[str]:
    """`count` held-out task ids, evenly spaced over the persona's (None: every persona's)."""
    env = gym.make("clawgym/Chat-v0", split="test", persona=persona, questions_per_episode=1)
    ids = list(env.unwrapped.task_ids())  # type: ignore[attr-defined]
    env.close()
    return evenly_spaced(ids, count)


def held_out_score(
    engine: EmbeddedEngine,
    persona: str | None,
    tasks: int,
    max_tokens: int,
    adapter: str | None = POLICY,
) -> HeldOut:
    """First-reply scores on held-out chat tasks, greedy, decoded as one batch, by the
    engine's `adapter` (POLICY: the one loaded last; BASE: the base model).

    `max_tokens` should let an unconstrained reply run past the point where the check stops
    rewarding it: a reply cut short by the budget would look briefer than the policy is.
    """
    chats = []
    observations = []
    for seed, task_id in enumerate(held_out_tasks(persona, tasks)):  # the same each time
        env = gym.make("clawgym/Chat-v0", split="test", persona=persona, questions_per_episode=1)
        observation, _ = env.reset(seed=seed, options={"task_id": task_id})
        chats.append(env)
        observations.append(observation)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    with ThreadPoolExecutor(len(observations)) as pool:
        replies = list(
            pool.map(lambda obs: engine.generate(obs, None, greedy, adapter), observations)
        )
    scores, topical = [], []
    for env, reply in zip(chats, replies, strict=True):
        _, _, _, _, info = env.step(dict(reply.message))
        scores.append(float(info["first_reply_score"]))
        topical.append(bool(info["first_reply_on_topic"]))
        env.close()
    return HeldOut(tuple(scores), tuple(topical))


def method_config(name: str) -> MethodConfig:
    """The method's settings as `trainers.run method=NAME` composes them.

    Raises:
        ValueError: no such method.
    """
    path = METHOD_CONFIGS / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in METHOD_CONFIGS.glob("*.yaml"))
        raise ValueError(f"unknown method {name!r}; choose from {known}")
    merged = OmegaConf.merge(OmegaConf.structured(MethodConfig), OmegaConf.load(path))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def run_config(
    args: argparse.Namespace,
    method: str,
    steps: int,
    overlap: bool,
    threads: int | None = None,
    seed: int = 0,
) -> RunConfig:
    config = RunConfig()
    config.seed = seed
    config.model.name = args.model
    config.method = method_config(method)
    config.method.experience_max_tokens = args.experience_max_tokens
    persona = None if args.persona == "all" else args.persona
    config.env = {
        "chat": EnvConfig(
            id="clawgym/Chat-v0",
            kwargs={"split": "train", "persona": persona, "questions_per_episode": 2},
            outcome_weight=0.0,
            group_size=args.group_size,
        )
    }
    config.engine.threads = threads or args.threads
    config.trainer.max_steps = steps
    config.trainer.batch_turns = args.batch_turns
    config.trainer.overlap = overlap
    config.trainer.lr = args.lr
    # Methods are compared at the same steps and the same batches: a run whose policy has
    # learned the persona (every simulated user satisfied, so every group's judge scores
    # equal) trains on to the last step, on whole groups, instead of stopping or playing
    # hundreds of episodes a step in search of a group that disagrees (SmolLM2 on `brief`
    # got there by step 8, after which dynamic sampling played 300 episodes a step).
    config.rollout.max_signalless_groups = 0
    config.method.filter_groups = False
    config.sampling.max_tokens = args.max_tokens
    config.judge.kind = args.judge
    config.judge.max_tokens = 48
    config.judge.hint_selection = args.hint_selection
    return config


def scored_steps(steps: int, every: int) -> list[int]:
    """The trained steps whose adapters are scored: every `every`-th and the last."""
    chosen = set(range(every, steps + 1, every)) if every > 0 else set()
    return sorted(chosen | {steps})


def learn(
    args: argparse.Namespace,
    method: str,
    seed: int,
    scorer: Scorer,
) -> dict[str, Any]:
    """Trains one method at one seed (unless its run reached its steps) and scores its
    adapters at `scored_steps`; returns the run's record (`benchmarks.learning_report`),
    kept beside the run as benchmark.json and read back from there next time."""
    run_dir = args.out / method / f"seed-{seed}"
    kept = run_dir / "benchmark.json"
    if kept.exists():
        record = dict(json.loads(kept.read_text()))
        if [h["step"] for h in record["held_out"]] == [
            0,
            *scored_steps(args.steps, args.eval_every),
        ]:
            return record  # scored as asked already
    wall = None
    if not (run_dir / "adapters" / f"v{args.steps}").exists():
        config = run_config(args, method, args.steps, overlap=True, seed=seed)
        wall = train(config, run_dir).wall_s
    held_out = [{"step": 0, **scorer.base()}]
    for step in scored_steps(args.steps, args.eval_every):
        held_out.append({"step": step, **scorer.adapter(run_dir / "adapters" / f"v{step}")})
    training = [
        {"step": row["step"], **{key: row.get(key) for key in TRAINING_KEYS}}
        for row in step_rows(read_metrics(run_dir))
    ]
    record = {
        "method": method,
        "seed": seed,
        "wall_s": wall,
        "held_out": held_out,
        "training": training,
    }
    kept.write_text(json.dumps(record, indent=1))
    return record


class Scorer:
    """Scores the base model and adapters on the held-out tasks with one engine, each
    adapter served as a version of its own (so no two share a prefix cache)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.engine = EmbeddedEngine(args.model, threads=args.threads)
        self.versions: Iterator[int] = itertools.count(1)
        self._base: dict[str, list[Any]] | None = None

    def _score(self, adapter: str | None) -> dict[str, list[Any]]:
        args = self.args
        persona = None if args.persona == "all" else args.persona
        found = held_out_score(self.engine, persona, args.eval_tasks, args.eval_max_tokens, adapter)
        return {"scores": list(found.scores), "on_topic": list(found.on_topic)}

    def base(self) -> dict[str, list[Any]]:
        """The base model's scores (greedy: the same for every run, scored once)."""
        if self._base is None:
            self._base = self._score(BASE)
        return self._base

    def adapter(self, path: Path) -> dict[str, list[Any]]:
        self.engine.load_adapter(str(path), next(self.versions))
        return self._score(POLICY)

    def close(self) -> None:
        self.engine.close()


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch-turns", type=int, default=8)
    parser.add_argument("--persona", default="brief", help="a persona's key, or all")
    parser.add_argument(
        "--methods",
        nargs="*",
        default=["combine", "topk_combine", "oel"],
        help="method= names; differences are to the first; none: speed-up only",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument(
        "--eval-every", type=int, default=4, help="score every N-th adapter (and the last)"
    )
    parser.add_argument(
        "--judge",
        default="feedback",
        help="judge kind (trainers/judge.py); the 135M self-judge reads feedback poorly",
    )
    parser.add_argument("--hint-selection", default="overlap", help="judge.hint_selection")
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
    parser.add_argument(
        "--experience-max-tokens",
        type=int,
        default=256,
        help="oel: the notes' bound (OpenClaw-RL: 2048, minutes a session on a CPU)",
    )
    parser.add_argument("--speedup-steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("runs/benchmark-learning"))
    args = parser.parse_args(argv)
    if args.steps < 1 or args.eval_every < 0:
        parser.error("--steps must be >= 1 and --eval-every >= 0")
    return args


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


def compare(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every method at every seed, trained and scored (one engine scores them all)."""
    scorer = Scorer(args)
    try:
        return [learn(args, method, seed, scorer) for method in args.methods for seed in args.seeds]
    finally:
        scorer.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    console = Console(width=max(Console().width, 160))  # the comparison's ten columns
    if args.methods:
        runs = compare(args)
        (args.out / "learning.json").write_text(json.dumps(runs, indent=1))
        scores = step_scores(runs, args.methods)
        title = (
            f"learning on Chat-v0 ({args.persona}), {args.model}, judge={args.judge}, lr "
            f"{args.lr:g}, {args.steps} steps of {args.batch_turns} turns, seeds {args.seeds}, "
            f"{args.eval_tasks} held-out tasks"
        )
        console.print(comparison_table(title, scores, args.methods[0]))
        plot(scores, runs, args.out / "learning.png")
        console.print(f"plot: {args.out / 'learning.png'}")
    if args.speedup_steps:
        console.print(speedup_table(args, speedup(args)))


if __name__ == "__main__":
    main()
