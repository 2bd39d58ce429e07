"""Does a policy learn in the agentic environments? Held-out pass@1, with its 95% Wilson
interval, and pass@k (k samples a task, k the env's group size) of the base model, after
supervised fine-tuning on the env's reference demonstrations, and after RL started from that
SFT adapter (`binary` on the env's outcome, whole groups in order; `binary-dynamic` the same
with dynamic sampling, `method.filter_groups=true`; `combine` with the self-judge's step-wise
scores and hints beside the outcome).

    python -m benchmarks.agentic_learning [--envs shop toolcall terminal] [--model smollm2-135m]
        [--methods binary binary-dynamic combine] [--demonstrations 160] [--sft-steps 30]
        [--rl-steps 12] [--rl-lr 1e-4] [--eval-episodes 60] [--rl-eval-every N] [--check-start]
        [--out runs/agentic-learning]

Every stage is an ordinary training run (`python -m trainers.run`, its directory under
`--out`), so each can be inspected, resumed, or put on the leaderboard
(`benchmarks.run policy=adapter:RUN_DIR@all`); a stage whose run finished is not run again.
The scores are the runs' own held-out evaluations (`eval.episodes` tasks of the test split,
evenly spaced, greedy): the SFT run's "before" is the base model, its "after" the SFT
adapter, which is also every RL run's start. An RL run does not evaluate that start again
(`eval.before=false`: 12 to 24 minutes per run at 200 ToolCall tasks on a 2-core CPU)
unless `--check-start` asks it to, as a check that it starts where SFT ended. Prints a
table per env and method and draws `learning.png`, pass@1 against training steps with the
intervals.

pass@k is drawn at the start of each run (the base model) and at its end, not at the
evaluations between (`--pass-k-at`: `after` alone spares the base model's samples, which
run to the token budget every turn).

Envs: `shop` is ToolCall-v0's generated shopping sums (`env=shop`: look each price up, add
them with the calculator, answer; four turns an episode), the multi-step tool task a 135M
model partly solves after a short imitation; `toolcall` is ToolCall-v0 on BFCL's single-turn
categories; `terminal` is Terminal-v0 on InterCode-ALFA's bash tasks in bubblewrap, five
turns an episode.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from agents.store import Store
from agents.trajectory import TurnType
from envs.core import solved
from trainers.metrics import read_metrics, step_rows

logger = logging.getLogger(__name__)

ENVS: dict[str, tuple[str, ...]] = {
    "shop": ("env=shop",),
    "toolcall": ("env=toolcall", "env.toolcall.kwargs.tasks=bfcl_single_turn"),
    "terminal": (
        "env=terminal",
        "env.terminal.kwargs.sandbox=bwrap",
        "env.terminal.kwargs.max_turns=5",
    ),
}
"""Each env's overrides of `trainers.run`."""

RL_METHODS: dict[str, tuple[str, ...]] = {
    "binary": ("method=binary", "judge=env", "method.filter_groups=false"),
    "binary-dynamic": ("method=binary", "judge=env", "method.filter_groups=true"),
    "combine": ("method=combine", "judge=self"),
}
"""Each RL method's overrides: binary learns from the env's outcome alone, taking whole
groups in order (a group whose rollouts all score the same adds turns of advantage 0; the
filter is on by default, so it is turned off by name); binary-dynamic plays more groups
until a step holds enough with reward variance (DAPO's dynamic sampling); combine adds the
self-judge's per-turn scores and its hints (on-policy distillation)."""


@dataclass(frozen=True)
class Stage:
    """One training run of the benchmark."""

    env: str
    name: str
    """sft, or an RL method."""
    overrides: tuple[str, ...]

    def run_dir(self, out: Path) -> Path:
        return out / f"{self.env}-{self.name}"


def stages(args: argparse.Namespace) -> list[Stage]:
    """Each env's SFT run, then its RL runs from the SFT adapter, in that order."""
    common = (
        f"model={args.model}",
        f"eval.episodes={args.eval_episodes}",
        f"seed={args.seed}",
        f"eval.pass_k_at=[{','.join(args.pass_k_at)}]",
    )
    planned = []
    for env in args.envs:
        planned.append(
            Stage(
                env,
                "sft",
                (
                    *ENVS[env],
                    *common,
                    "method=sft",
                    f"sft.episodes={args.demonstrations}",
                    f"trainer.max_steps={args.sft_steps}",
                    f"sft.lr={args.sft_lr}",
                    f"eval.every={max(args.sft_steps // 2, 1)}",
                ),
            )
        )
    for method in args.methods:
        for env in args.envs:
            sft_dir = Stage(env, "sft", ()).run_dir(args.out)
            planned.append(
                Stage(
                    env,
                    method,
                    (
                        *ENVS[env],
                        *common,
                        *RL_METHODS[method],
                        f"trainer.init_adapter={sft_dir}",
                        "sft.warm_start_steps=0",  # it starts from the SFT run instead
                        f"trainer.max_steps={args.rl_steps}",
                        f"trainer.lr={args.rl_lr}",
                        f"eval.every={rl_eval_every(args)}",
                        f"eval.before={str(args.check_start).lower()}",
                    ),
                )
            )
    return planned


def rl_eval_every(args: argparse.Namespace) -> int:
    """Steps between an RL run's evaluations: `--rl-eval-every`, by default half its steps
    (its start, middle and end); 0 evaluates at its start and end only."""
    if args.rl_eval_every is not None:
        return int(args.rl_eval_every)
    return max(args.rl_steps // 2, 1)


def run_stage(stage: Stage, out: Path) -> dict[str, Any]:
    """Runs one stage (unless its run finished before) and returns its summary."""
    run_dir = stage.run_dir(out)
    summary = run_dir / "summary.json"
    if not summary.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "trainers.run", *stage.overrides, f"run_dir={run_dir}"]
        logger.info("%s %s: %s", stage.env, stage.name, " ".join(command[1:]))
        started = time.monotonic()
        with open(run_dir / "benchmark.log", "a") as log:
            done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"{stage.env} {stage.name} failed (exit {done.returncode}); see "
                f"{run_dir / 'benchmark.log'}"
            )
        logger.info("%s %s done in %.0f s", stage.env, stage.name, time.monotonic() - started)
    result: dict[str, Any] = json.loads(summary.read_text())
    return result


def curve(run_dir: Path, env: str) -> list[dict[str, Any]]:
    """The run's held-out evaluations of `env`, in step order."""
    return [r for r in read_metrics(run_dir) if r.get("env") == env and "eval_pass_at_1" in r]


def wall_to_last_step(records: list[dict[str, Any]]) -> float:
    """Seconds of wall time a run spent up to its last step, over every process that ran
    it: each step row's `elapsed_s` counts from its own process's start, so a drop in it
    marks a resumed process, and each process adds the elapsed time of its last step. A
    run's final evaluation comes after its last step and is left out; a process's start
    evaluation is counted in."""
    total, previous = 0.0, 0.0
    for row in step_rows(records):
        elapsed = float(row["elapsed_s"])
        if elapsed < previous:  # a new process
            total += previous
        previous = elapsed
    return total + previous


def table(results: list[tuple[Stage, dict[str, Any]]]) -> Table:
    """One row per env and policy: base, SFT, and SFT + each RL method."""
    grid = Table(
        title="held-out pass@1 (95% Wilson interval), pass@k and mean reward",
        caption="wall s: to the run's last step, over all its processes, final evaluation out",
    )
    columns = (
        "env",
        "policy",
        "pass@1",
        "95% interval",
        "pass@k",
        "reward",
        "n",
        "steps",
        "wall s",
    )
    for column in columns:
        grid.add_column(column, justify="left" if column in ("env", "policy") else "right")
    for stage, summary in results:
        scores = summary["held_out"][stage.env]
        rows = [("base", scores["before"], 0, 0.0)] if stage.name == "sft" else []
        label = "SFT" if stage.name == "sft" else f"SFT + {stage.name}"
        wall = wall_to_last_step(read_metrics(Path(summary["run_dir"])))
        rows.append((label, scores["after"], summary["steps"], wall))
        if stage.name != "sft" and scores["before"] is not None:  # --check-start
            rows.insert(0, ("  (its start: SFT)", scores["before"], 0, 0.0))
        for policy, score, steps, wall in rows:
            grid.add_row(
                stage.env,
                policy,
                f"{score['pass_at_1']:.3f}",
                f"[{score['low']:.3f}, {score['high']:.3f}]",
                pass_at_k(score),
                f"{score['reward']:.3f}",  # partial credit counts here, not in pass@1
                str(score["episodes"]),
                str(steps),
                f"{wall:.0f}" if wall else "-",
            )
    return grid


def pass_at_k(score: dict[str, Any]) -> str:
    """An evaluation's pass@k with its k and 95% interval, or "-" where it drew no samples
    (`eval.pass_k_at` left it out, or a summary written before pass@k existed)."""
    if score.get("pass_at_k") is None:
        return "-"
    low, high = score["pass_at_k_low"], score["pass_at_k_high"]
    return f"{score['pass_at_k']:.3f} (k={score['k']}) [{low:.3f}, {high:.3f}]"


FAMILY_ENVS = ("toolcall",)
"""Envs whose task ids name a family (BFCL's categories); icalfa's are numbers alone."""


def task_family(task_id: str) -> str:
    """A task's family: its id less the source prefix and the trailing number
    (`bfcl/live_multiple_7-3-2` is `live_multiple`, a BFCL category)."""
    return re.sub(r"_\d[\d-]*$", "", task_id.split("/", 1)[-1])


def solved_by_family(run_dir: Path, env: str) -> list[dict[str, tuple[int, int]]]:
    """Each held-out evaluation of `env` stored in the run (in the order played): per task
    family, (solved, played). An evaluation is told apart by the policy version that played
    it; a task it played twice (a stopped run replays its last evaluation when resumed)
    counts its last play."""
    with Store(run_dir / "store.sqlite") as store:
        sessions = [s for s in store.sessions() if s.env_id == f"eval/{env}"]  # as created
        ids = {s.session_id for s in sessions}
        version = {
            turn.session_id: turn.policy_version
            for _, turn in store.turns(turn_type=TurnType.SIDE)
            if turn.session_id in ids
        }
    last_play = {
        (version[s.session_id], s.task_id or ""): s for s in sessions if s.session_id in version
    }
    evaluations: dict[int, dict[str, tuple[int, int]]] = {}
    for (played, task_id), session in last_play.items():
        families = evaluations.setdefault(played, {})
        family = task_family(task_id)
        successes, count = families.get(family, (0, 0))
        success = session.outcome_reward is not None and solved(session.outcome_reward)
        families[family] = (successes + success, count + 1)
    return [evaluations[v] for v in sorted(evaluations)]


def family_table(results: list[tuple[Stage, dict[str, Any]]], out: Path, env: str) -> Table:
    """Solved / played per task family (BFCL's categories on ToolCall) for the base model,
    SFT and each RL run: which kinds of task a stage gained or lost."""
    columns: dict[str, dict[str, tuple[int, int]]] = {}
    for stage, _ in (r for r in results if r[0].env == env):
        evaluations = solved_by_family(stage.run_dir(out), env)
        if stage.name == "sft" and evaluations:
            columns["base"] = evaluations[0]
        if evaluations:
            columns["SFT" if stage.name == "sft" else f"SFT + {stage.name}"] = evaluations[-1]
    grid = Table(title=f"{env}: held-out tasks solved per task family (last evaluation)")
    grid.add_column("family")
    for name in columns:
        grid.add_column(name, justify="right")
    for family in sorted({f for column in columns.values() for f in column}):
        cells = [column.get(family, (0, 0)) for column in columns.values()]
        grid.add_row(family, *(f"{won}/{count}" for won, count in cells))
    return grid


def plot(results: list[tuple[Stage, dict[str, Any]]], out: Path, sft_steps: int) -> Path:
    """pass@1 against training steps per env: SFT from step 0, each RL run from where SFT
    ended; the bands are the 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    envs = list(dict.fromkeys(stage.env for stage, _ in results))
    figure, axes = plt.subplots(1, len(envs), figsize=(6 * len(envs), 4), squeeze=False)
    for panel, env in zip(axes[0], envs, strict=True):
        sft_end = curve(Stage(env, "sft", ()).run_dir(out), env)[-1:]
        for stage, _ in (r for r in results if r[0].env == env):
            points = curve(stage.run_dir(out), env)
            offset = 0 if stage.name == "sft" else sft_steps
            if stage.name != "sft" and points and points[0]["step"] != 0:
                # not evaluated at its start (eval.before=false): it starts where SFT ended
                points = [{**point, "step": 0} for point in sft_end] + points
            steps = [p["step"] + offset for p in points]
            panel.plot(steps, [p["eval_pass_at_1"] for p in points], marker="o", label=stage.name)
            panel.fill_between(
                steps,
                [p["eval_low"] for p in points],
                [p["eval_high"] for p in points],
                alpha=0.15,
            )
        panel.axvline(sft_steps, color="grey", linestyle=":", linewidth=1)
        panel.set_title(env)
        panel.set_xlabel("training step (SFT, then RL)")
        panel.set_ylabel("held-out pass@1")
        panel.set_ylim(0, 1)
        panel.legend()
    figure.tight_layout()
    path = out / "learning.png"
    figure.savefig(path)
    plt.close(figure)
    return path


LEADERBOARD_SETS = {"toolcall": "toolcall/bfcl-test", "terminal": "terminal/icalfa-test"}
"""Each env's leaderboard task set (`benchmarks/leaderboard/suites.py`)."""


def leaderboard(
    results: list[tuple[Stage, dict[str, Any]]], out: Path, limit: int, model: str
) -> None:
    """Puts every run's final adapter on the leaderboard page (`benchmarks.run`), per env,
    beside the base model, on `limit` tasks of the env's held-out task set."""
    for env in dict.fromkeys(stage.env for stage, _ in results):
        adapters = [f"adapter:{s.run_dir(out)}@latest" for s, _ in results if s.env == env]
        command = [
            sys.executable,
            "-m",
            "benchmarks.run",
            f"suite={LEADERBOARD_SETS[env]}",
            f"limit={limit}",
            f"policy=[{','.join([model, *adapters])}]",
            f"out_dir={out / 'leaderboard'}",
        ]
        logger.info("leaderboard: %s", " ".join(command[2:]))
        subprocess.run(command, check=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", nargs="+", default=list(ENVS), choices=list(ENVS))
    parser.add_argument("--methods", nargs="+", default=list(RL_METHODS), choices=list(RL_METHODS))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--demonstrations", type=int, default=160, help="per env")
    parser.add_argument("--sft-steps", type=int, default=30)
    parser.add_argument("--sft-lr", type=float, default=5e-4)
    parser.add_argument("--rl-steps", type=int, default=12)
    parser.add_argument("--rl-lr", type=float, default=1e-4)
    parser.add_argument("--eval-episodes", type=int, default=60)
    parser.add_argument(
        "--rl-eval-every",
        type=int,
        default=None,
        help="steps between an RL run's evaluations (default: half its steps; 0: start and end)",
    )
    parser.add_argument(
        "--check-start",
        action="store_true",
        help="evaluate each RL run's start again (the SFT adapter, already scored by SFT)",
    )
    parser.add_argument(
        "--pass-k-at",
        nargs="+",
        default=["before", "after"],
        choices=["before", "every", "after"],
        help="the evaluations that draw pass@k samples (eval.pass_k_at)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/agentic-learning"))
    parser.add_argument(
        "--leaderboard",
        type=int,
        default=0,
        metavar="TASKS",
        help="also put every run on the leaderboard page, on this many held-out tasks",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for stage in stages(args):
        try:
            results.append((stage, run_stage(stage, args.out)))
        except RuntimeError as error:  # one env's failure leaves the others' results
            logger.error("%s", error)
    console = Console()
    console.print(table(results))
    for env in dict.fromkeys(stage.env for stage, _ in results):
        if env in FAMILY_ENVS:
            console.print(family_table(results, args.out, env))
    logger.info("curves: %s", plot(results, args.out, args.sft_steps))
    if args.leaderboard:
        leaderboard(results, args.out, args.leaderboard, args.model)


if __name__ == "__main__":
    main()
