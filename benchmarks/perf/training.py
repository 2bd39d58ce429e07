"""Training served by vLLM against training served by the embedded engine: the same run
(`python -m trainers.run`, same config and seed) once per engine, in one invocation.

    python -m benchmarks.perf.training [--model smollm2-135m] [--steps 4] [--batch-turns 8]
        [--max-tokens 64] [--method combine] [--judge feedback] [--env chat] [--out DIR]

Each run is a subprocess of its own (one engine's memory and threads never touch the
other's). Figures, from each run's metrics.jsonl, store and summary:

- seconds per step: from the first step's end to the last's, over the steps between (the
  steady state; the first step also waits for the first batch to be played);
- time to the last step: from the pipeline's start (engine, learner and proxy are up);
- rollout tokens/s: completion tokens the rollouts sampled by the last step, over that time;
- publish-to-served latency: how long a new adapter version takes from the learner's saved
  directory to the engine serving it (the proxy's publish call), median and max;
- start-up: the whole wall time less the time to the last step (model loads, vLLM start);
- the learner's on-policy log-prob gap against the engine's own rollout log-probs.

The ratio column is embedded / vllm for times (above 1: vLLM is faster) and vllm / embedded
for rates.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from trainers.metrics import read_metrics

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Measured:
    """One engine's run."""

    engine: str
    seconds_per_step: float
    time_to_last_step: float
    rollout_tokens_per_s: float
    publish_ms_median: float
    publish_ms_max: float
    learner_step_s: float
    startup_s: float
    logprob_gap: float | None
    logprob_gap_max: float | None


def steady_seconds_per_step(elapsed: list[float]) -> float:
    """Seconds per step between the first step's end and the last's (all steps when one)."""
    if len(elapsed) < 2:
        return elapsed[0] if elapsed else float("nan")
    return (elapsed[-1] - elapsed[0]) / (len(elapsed) - 1)


def measure(engine: str, args: argparse.Namespace, run_dir: Path) -> Measured:
    """Runs the training once on `engine` and reads its figures."""
    command = [
        sys.executable,
        "-m",
        "trainers.run",
        f"engine={engine}",
        f"model={args.model}",
        f"env={args.env}",
        f"method={args.method}",
        f"judge={args.judge}",
        # RL steps alone: no warm start, no held-out evaluation in the timed run
        "sft.warm_start_steps=0",
        "eval.episodes=0",
        f"trainer.max_steps={args.steps}",
        f"trainer.batch_turns={args.batch_turns}",
        f"sampling.max_tokens={args.max_tokens}",
        f"run_dir={run_dir}",
        *args.overrides,
    ]
    logger.info("running %s", " ".join(command[2:]))
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {engine} run failed:\n{done.stderr[-4000:]}")
    rows = [row for row in read_metrics(run_dir) if "env" not in row]
    summary = json.loads((run_dir / "summary.json").read_text())
    elapsed = [float(r["elapsed_s"]) for r in rows]
    publish = [float(r["publish_ms"]) for r in rows]
    return Measured(
        engine=engine,
        seconds_per_step=steady_seconds_per_step(elapsed),
        time_to_last_step=elapsed[-1],
        rollout_tokens_per_s=rows[-1]["rollout_tokens"] / elapsed[-1],
        publish_ms_median=statistics.median(publish),
        publish_ms_max=max(publish),
        learner_step_s=statistics.mean(float(r["seconds"]) for r in rows),
        startup_s=float(summary["wall_s"]) - elapsed[-1],
        logprob_gap=summary["logprob_gap"],
        logprob_gap_max=summary["logprob_gap_max"],
    )


def table(embedded: Measured, vllm: Measured, title: str) -> Table:
    """The two runs side by side with their ratio."""
    out = Table(title=title)
    for column in ("figure", "embedded", "vllm", "ratio"):
        out.add_column(column, justify="left" if column == "figure" else "right")
    times = [
        ("seconds per step (steady)", "seconds_per_step"),
        ("seconds to the last step", "time_to_last_step"),
        ("publish-to-served ms (median)", "publish_ms_median"),
        ("publish-to-served ms (max)", "publish_ms_max"),
        ("learner seconds per step", "learner_step_s"),
        ("start-up seconds", "startup_s"),
    ]
    for label, name in times:
        a, b = getattr(embedded, name), getattr(vllm, name)
        out.add_row(label, f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}x" if b else "-")
    a, b = embedded.rollout_tokens_per_s, vllm.rollout_tokens_per_s
    out.add_row("rollout tokens/s", f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}x" if a else "-")
    for label, name in (
        ("log-prob gap (mean)", "logprob_gap"),
        ("log-prob gap (max)", "logprob_gap_max"),
    ):
        a, b = getattr(embedded, name), getattr(vllm, name)
        out.add_row(label, _maybe(a), _maybe(b), "")
    return out


def _maybe(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--method", default="combine")
    parser.add_argument("--judge", default="feedback")
    parser.add_argument("--env", default="chat")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for both runs")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch)
        embedded = measure("embedded", args, out / "embedded")
        vllm = measure("vllm", args, out / "vllm")
    title = (
        f"training on {args.model}: {args.steps} steps of {args.batch_turns} turns, "
        f"env={args.env} method={args.method} judge={args.judge}"
    )
    Console().print(table(embedded, vllm, title))


if __name__ == "__main__":
    main()
