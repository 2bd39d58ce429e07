"""Learner memory and speed: one LoRA step at batch x tokens on a real model, ours against a
plain peft step (full logits, cross-entropy over the whole vocabulary) as the baseline.

    python -m benchmarks.perf.learner [--model smollm2-135m] [--batch 8] [--tokens 512]

Each case runs in its own process so its peak resident memory is its own (ru_maxrss,
model weights included). Prints one table; ratios are against the baseline.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

CASES = (
    "plain peft (baseline)",
    "learner (default: mmap threshold 1 MiB)",
    "learner, glibc's adaptive malloc",
    "learner, no checkpointing",
)


def _plain_step(model_name: str, batch: int, tokens: int) -> float:
    from peft import LoraConfig, get_peft_model

    from agents import models

    base, _ = models.load(model_name)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=_PROJECTIONS, task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(100, 20000, (batch, tokens), generator=torch.Generator().manual_seed(0))
    started = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return time.perf_counter() - started


def _learner_step(
    model_name: str, batch: int, tokens: int, checkpointing: bool, mmap_threshold_kb: int
) -> float:
    from trainers.config import TrainerConfig
    from trainers.learner import Learner, TrainSample

    config = TrainerConfig(
        gradient_checkpointing=checkpointing,
        micro_batch_tokens=batch * tokens,
        mmap_threshold_kb=mmap_threshold_kb,
    )
    with tempfile.TemporaryDirectory() as run_dir:
        learner = Learner(model_name, config, Path(run_dir))
        generator = torch.Generator().manual_seed(0)
        half = tokens // 2
        samples = [
            TrainSample(
                seq=i,
                prompt_ids=tuple(torch.randint(100, 20000, (half,), generator=generator).tolist()),
                completion_ids=tuple(
                    torch.randint(100, 20000, (tokens - half,), generator=generator).tolist()
                ),
                rollout_logprobs=tuple([-2.0] * (tokens - half)),
                advantages=tuple([1.0 if i % 2 else -1.0] * (tokens - half)),
                policy_version=0,
            )
            for i in range(batch)
        ]
        started = time.perf_counter()
        learner.step(samples)
        return time.perf_counter() - started


_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _run_case(case: str, model: str, batch: int, tokens: int) -> dict[str, float]:
    """Runs one case in a fresh process; returns its step seconds and peak RSS in GiB."""
    command = [sys.executable, "-m", "benchmarks.perf.learner", "--case", case, "--model", model]
    command += ["--batch", str(batch), "--tokens", str(tokens)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _child(case: str, model: str, batch: int, tokens: int) -> None:
    if case == CASES[0]:
        seconds = _plain_step(model, batch, tokens)
    else:
        seconds = _learner_step(
            model,
            batch,
            tokens,
            checkpointing=case != CASES[3],
            mmap_threshold_kb=0 if case == CASES[2] else 1024,
        )
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    sys.stdout.write(json.dumps({"seconds": seconds, "peak_gib": peak_gib}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--case", choices=CASES, help="run one case in this process (internal)")
    args = parser.parse_args()
    if args.case:
        _child(args.case, args.model, args.batch, args.tokens)
        return
    table = Table(
        title=f"LoRA step on {args.model}, {args.batch} x {args.tokens} tokens (fp32, CPU)"
    )
    for column in ("case", "peak RSS GiB", "step s", "memory vs baseline", "time vs baseline"):
        table.add_column(column, justify="left" if column == "case" else "right")
    baseline: dict[str, float] | None = None
    for case in CASES:
        found = _run_case(case, args.model, args.batch, args.tokens)
        baseline = baseline or found
        table.add_row(
            case,
            f"{found['peak_gib']:.2f}",
            f"{found['seconds']:.1f}",
            f"{found['peak_gib'] / baseline['peak_gib']:.2f}x",
            f"{found['seconds'] / baseline['seconds']:.2f}x",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
