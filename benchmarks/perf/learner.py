"""Learner memory and speed: LoRA steps at batch x tokens on a real model, ours against a
plain peft step (full logits, cross-entropy over the whole vocabulary) as the baseline, and
a step with the top-k OPD term (`method=topk_opd`: the hinted teacher's extra pass).

    python -m benchmarks.perf.learner [--model smollm2-135m] [--batch 8] [--tokens 512]
        [--prefix 0]
    python -m benchmarks.perf.learner --device cuda --shape smollm2-135m --shape qwen3-1.7b

`--prefix N` gives every row the same first N tokens, as an agent's turns share their system
prompt and tool schemas (the main job's arith turns: 271 of ~380 tokens): the learner then
runs them once (`trainer.share_prefix`); the plain peft step runs every row whole.

On a CPU the weights are fp32 and one step is timed; on a GPU (`--device cuda`) the base
weights are bf16 where the device has it (the learner's own rule), one step warms up and
`--steps` are timed. `--shape NAME` times a model of a published architecture with random
weights instead of `--model`: a step's cost depends on the shapes, not the values, so a GPU
machine that cannot receive the weights still gives the real figures.

Each case runs in its own process so its peak memory is its own (resident memory on a CPU,
model weights included; the GPU allocator's peak on a GPU). Prints one table per model;
ratios are against the baseline.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

CASES = (
    "plain peft (baseline)",
    "learner (default: checkpointing auto)",
    "learner, mmap threshold 1 MiB",
    "learner, no checkpointing",
    "learner, checkpointing",
    "learner, top-k OPD (k=4, teacher pass)",
)
GPU_CASES = (CASES[0], CASES[1], CASES[3], CASES[4], CASES[5])  # glibc's malloc holds no GPU memory
CHECKPOINTING = {
    CASES[1]: "auto",
    CASES[2]: "auto",
    CASES[3]: "false",
    CASES[4]: "true",
    CASES[5]: "auto",
}
HINT_TOKENS = 24
"""The top-k case: a hint of this many tokens lengthens each turn's teacher prompt."""

# Published architectures (their config.json fields), built with random weights by --shape.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
    },
    "qwen3-0.6b": {
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
    },
    "qwen3-1.7b": {
        "model_type": "qwen3",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
    },
}
logger = logging.getLogger(__name__)
_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_shape(name: str, target: Path) -> Path:
    """A model directory of architecture `name` with random bf16 weights and the tiny
    model's tokenizer (a step never tokenizes: its ids are drawn at random)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from agents import models

    fields = dict(SHAPES[name])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(target)
    models.load_tokenizer("tiny").save_pretrained(target)
    return target


def _random_ids(count: int, generator: torch.Generator) -> tuple[int, ...]:
    return tuple(torch.randint(100, 20000, (count,), generator=generator).tolist())


def _rows(batch: int, tokens: int, prefix: int) -> list[tuple[int, ...]]:
    """`batch` rows of `tokens` random ids, the first `prefix` the same in every row."""
    generator = torch.Generator().manual_seed(0)
    head = _random_ids(prefix, generator)
    return [head + _random_ids(tokens - prefix, generator) for _ in range(batch)]


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _plain_steps(
    model_name: str, batch: int, tokens: int, prefix: int, device: str, steps: int
) -> float:
    """Seconds per step of the textbook peft step (full logits), in the learner's dtype."""
    from peft import LoraConfig, get_peft_model

    from agents import models
    from trainers.lora import learner_dtype

    base, _ = models.load(model_name)
    dtype = learner_dtype("auto", device, device == "cuda" and torch.cuda.is_bf16_supported())
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=_PROJECTIONS, task_type="CAUSAL_LM")
    model = get_peft_model(base.to(device=device, dtype=dtype), lora)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.tensor(_rows(batch, tokens, prefix), device=device)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _timed(step, device, steps)


def _learner_steps(
    model_name: str,
    batch: int,
    tokens: int,
    prefix: int,
    checkpointing: str,
    mmap_threshold_kb: int,
    device: str,
    steps: int,
    topk: bool = False,
) -> float:
    """Seconds per step of `Learner.step` on `batch` turns of `tokens` (half prompt, its
    first `prefix` tokens the same in every turn); `topk`: every turn hinted, with the
    top-k OPD term (`trainers.topk`: the teacher's pass over the hinted prompt and the
    completion, and the current log-probs at each position's 4 ids)."""
    from trainers.config import TrainerConfig
    from trainers.learner import Learner
    from trainers.learning import TrainSample
    from trainers.topk import TopKSettings

    config = TrainerConfig(
        gradient_checkpointing=checkpointing,
        micro_batch_tokens=batch * tokens,
        mmap_threshold_kb=mmap_threshold_kb,
        device=device,
    )
    with tempfile.TemporaryDirectory() as run_dir:
        learner = Learner(model_name, config, Path(run_dir), TopKSettings() if topk else None)
        half = max(tokens // 2, prefix + 1)
        generator = torch.Generator().manual_seed(1)
        hint = _random_ids(HINT_TOKENS, generator)
        samples = [
            TrainSample(
                seq=i,
                prompt_ids=row[:half],
                completion_ids=row[half:],
                rollout_logprobs=tuple([-2.0] * (tokens - half)),
                advantages=tuple([1.0 if i % 2 else -1.0] * (tokens - half)),
                policy_version=0,
                teacher_prompt_ids=row[:half] + hint if topk else None,
                top_ids=tuple(_random_ids(4, generator) for _ in row[half:]) if topk else (),
                top_logprobs=tuple((-1.0, -2.0, -3.0, -4.0) for _ in row[half:]) if topk else (),
            )
            for i, row in enumerate(_rows(batch, tokens, prefix))
        ]
        return _timed(lambda: learner.step(samples), device, steps)


def _timed(step: Any, device: str, steps: int) -> float:
    """Seconds per step over `steps` steps, after one warm-up step on a GPU (its kernels'
    first launch and the allocator's growth are not what a run pays each step)."""
    if device == "cuda":
        step()
        _synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    _synchronize(device)
    return (time.perf_counter() - started) / steps


def _run_case(case: str, model: str, args: argparse.Namespace) -> dict[str, float]:
    """Runs one case in a fresh process; returns its step seconds and peak memory in GiB."""
    command = [sys.executable, "-m", "benchmarks.perf.learner", "--case", case, "--model", model]
    command += ["--batch", str(args.batch), "--tokens", str(args.tokens)]
    command += ["--prefix", str(args.prefix)]
    command += ["--device", args.device, "--steps", str(args.steps)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:  # out of memory, most often: the table says which case
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        logger.warning("%s on %s failed: %s", case, model, last)
        return {"error": 1.0}
    return json.loads(result.stdout.strip().splitlines()[-1])


def _child(case: str, model: str, args: argparse.Namespace) -> None:
    device = args.device
    if case == CASES[0]:
        seconds = _plain_steps(model, args.batch, args.tokens, args.prefix, device, args.steps)
    else:
        seconds = _learner_steps(
            model,
            args.batch,
            args.tokens,
            args.prefix,
            checkpointing=CHECKPOINTING[case],
            mmap_threshold_kb=1024 if case == CASES[2] else 0,
            device=device,
            steps=args.steps,
            topk=case == CASES[5],
        )
    if device == "cuda":
        peak_gib = torch.cuda.max_memory_allocated() / 2**30
    else:
        peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    sys.stdout.write(json.dumps({"seconds": seconds, "peak_gib": peak_gib}) + "\n")


def _table(title: str, memory: str, rows: list[tuple[str, dict[str, float]]], tokens: int) -> Table:
    table = Table(title=title)
    columns = ("case", f"peak {memory} GiB", "step s", "tokens/s", "memory vs baseline")
    for column in (*columns, "time vs baseline"):
        table.add_column(column, justify="left" if column == "case" else "right")
    baseline = rows[0][1]
    for case, found in rows:
        if "error" in found:
            table.add_row(case, "failed", "", "", "", "")
            continue
        ratios = ("-", "-")
        if "error" not in baseline:
            ratios = (
                f"{found['peak_gib'] / baseline['peak_gib']:.2f}x",
                f"{found['seconds'] / baseline['seconds']:.2f}x",
            )
        table.add_row(
            case,
            f"{found['peak_gib']:.2f}",
            f"{found['seconds']:.3f}",
            f"{tokens / found['seconds']:,.0f}",
            *ratios,
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), default=[])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument(
        "--prefix",
        type=int,
        default=0,
        help="tokens every row starts with (an agent's system prompt and tools); 0: none",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per case")
    parser.add_argument("--case", choices=CASES, help="run one case in this process (internal)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    if args.case:
        _child(args.case, args.model, args)
        return
    cases = GPU_CASES if args.device == "cuda" else CASES
    memory = "GPU" if args.device == "cuda" else "RSS"
    if args.device == "cuda":
        precision = f"{torch.cuda.get_device_name()}, bf16 base, fp32 LoRA"
    else:
        precision = "CPU, fp32"
    with tempfile.TemporaryDirectory() as scratch:
        targets = [(args.model, args.model)]
        if args.shape:
            targets = [
                (f"{s} (random weights)", str(build_shape(s, Path(scratch) / s)))
                for s in args.shape
            ]
        for label, model in targets:
            rows = [(case, _run_case(case, model, args)) for case in cases]
            shape = f"{args.batch} x {args.tokens} tokens"
            if args.prefix:
                shape += f", the first {args.prefix} shared"
            title = f"LoRA step on {label}, {shape} ({precision})"
            Console(width=160).print(_table(title, memory, rows, args.batch * args.tokens))


if __name__ == "__main__":
    main()
