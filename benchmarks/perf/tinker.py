"""The same LoRA steps in process and through Tinker: `trainers.learner.Learner.step` (the
local backend, the baseline) against `trainers.tinker_learner.TinkerLearner.step` (the
`backend=tinker` learner) talking to clawgym's own Tinker server on loopback, in one run, on
the same turns, both built from one `TrainerConfig`.

    python -m benchmarks.perf.tinker [--model smollm2-135m] [--batch 8] [--tokens 256]
        [--steps 3]

A Tinker step is a `forward_backward` (protobuf over HTTP, one future) and an `optim_step`;
its publish is `save_weights_for_sampler` plus the pointer file, the local one the adapter
written to disk. The work differs where the backends do: the local step first scores the
turns under the step's starting weights (the proximal log-probs its ratio and staleness
weights need) and, by default, recomputes activations (gradient checkpointing); the server
takes one forward and backward without checkpointing, its ratio to the rollout log-probs.
A second local row without checkpointing separates the two. Step times are medians over
`--steps`, after one untimed warm-up step each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from agents import models
from trainers.config import TrainerConfig
from trainers.learner import Learner
from trainers.learning import TrainSample

logger = logging.getLogger(__name__)


def turns(batch: int, tokens: int, vocab: int, seed: int = 0) -> list[TrainSample]:
    """`batch` turns of `tokens` random ids below `vocab` (half prompt, half completion),
    advantages +-1."""
    generator = torch.Generator().manual_seed(seed)
    half = tokens // 2

    def ids(count: int) -> tuple[int, ...]:
        return tuple(torch.randint(3, vocab, (count,), generator=generator).tolist())

    return [
        TrainSample(
            seq=i,
            prompt_ids=ids(half),
            completion_ids=ids(tokens - half),
            rollout_logprobs=tuple([-2.0] * (tokens - half)),
            advantages=tuple([1.0 if i % 2 else -1.0] * (tokens - half)),
            policy_version=0,
        )
        for i in range(batch)
    ]


def timed(call: Callable[[], Any], repeats: int) -> float:
    """Median seconds of `call` over `repeats` calls, after one untimed warm-up call."""
    call()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def measure_local(model: str, config: TrainerConfig, samples: list[TrainSample], steps: int):
    """(step s, publish s) of the in-process learner."""
    with tempfile.TemporaryDirectory() as run_dir:
        learner = Learner(model, config, Path(run_dir))
        return timed(lambda: learner.step(samples), steps), timed(learner.save_adapter, steps)


def measure_tinker(model: str, config: TrainerConfig, samples: list[TrainSample], steps: int):
    """(step s, publish s) of the Tinker learner against clawgym's server in this process."""
    import tinker

    from trainers.tinker.app import in_thread
    from trainers.tinker.service import TinkerService
    from trainers.tinker_learner import TinkerLearner

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    with tempfile.TemporaryDirectory() as scratch:
        server = TinkerService(model, Path(scratch) / "server")
        with (
            in_thread(server) as url,
            tinker.ServiceClient(base_url=url, api_key="tml-benchmark") as service,
        ):
            learner = TinkerLearner(service, model, config, Path(scratch) / "run")
            step = timed(lambda: learner.step(samples), steps)
            return step, timed(learner.save_adapter, steps)


def table(rows: list[tuple[str, float, float]], title: str, tokens: int) -> Table:
    grid = Table(title=title)
    for column in ("learner", "step s", "trained tokens/s", "step vs in-process", "publish s"):
        grid.add_column(column, justify="left" if column == "learner" else "right")
    baseline = rows[0][1]
    for name, step, publish in rows:
        grid.add_row(
            name,
            f"{step:.3f}",
            f"{tokens / step:,.0f}",
            f"{step / baseline:.2f}x",
            f"{publish:.3f}",
        )
    return grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per learner")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    config = TrainerConfig(micro_batch_tokens=args.batch * args.tokens, device="cpu")
    vocab = json.loads((models.resolve(args.model) / "config.json").read_text())["vocab_size"]
    samples = turns(args.batch, args.tokens, int(vocab))
    unchecked = dataclasses.replace(config, gradient_checkpointing="false")
    rows = [
        (
            "in process (the trainer's defaults; baseline)",
            *measure_local(args.model, config, samples, args.steps),
        ),
        (
            "in process, no checkpointing",
            *measure_local(args.model, unchecked, samples, args.steps),
        ),
        (
            "through Tinker (clawgym's server, loopback)",
            *measure_tinker(args.model, config, samples, args.steps),
        ),
    ]
    title = (
        f"LoRA step on {args.model}, {args.batch} turns x {args.tokens} tokens, "
        f"median of {args.steps} (CPU, fp32, {torch.get_num_threads()} threads)"
    )
    trained = args.batch * (args.tokens - args.tokens // 2)
    Console(width=160).print(table(rows, title, trained))


if __name__ == "__main__":
    main()
