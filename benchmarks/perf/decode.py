"""The embedded engine's decode rate on an agent's prompts: shared-prefix attention and merged
LoRA weights, each against the engine without either, measured in the same run.

    .venv/bin/python -m benchmarks.perf.decode [--model smollm2-135m] [--rows 64]
        [--tokens 48] [--rounds 3] [--rank 16] [--out FILE.json]

The workload is the main job's evaluation: `--rows` held-out Arith-v0 tasks' first prompts
(the env's system prompt and tool schemas, then the question: 300 tokens on SmolLM2, 282
of them the same in every prompt) queued at once, greedy, on a policy adapter of the
learner's shape (rank `--rank` on the seven projections, random non-zero weights; a
trained adapter costs the same). End-of-sequence is ignored, so that every row decodes
`--tokens` tokens and the settings decode the same work. One engine per setting:

- baseline: `share_prefixes=False, merge_lora=False` (the engine before either);
- merged: `merge_lora=True` (a uniform batch runs on the adapter's merged weights; the
  default engine);
- shared: `share_prefixes=True` (the rows read their common prefix from one block);
- both.

Each engine first plays one uncounted round (its prefix cache then holds the prompts, as
it does in an evaluation after its first wave, and the adapter is merged), then the settings
take turns `--rounds` times and each one's median rate is kept: a load that comes and goes
falls on all of them. `ratio` is tokens/s over the baseline's; `same tokens` and `max |dlogp|`
compare each setting's tokens and log-probs with the baseline's, row by row.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from rich.console import Console
from rich.table import Table

from agents import models
from agents.config import PROJECTIONS
from agents.engines.base import SamplingParams
from agents.engines.batch import END
from agents.engines.embedded import EmbeddedEngine
from envs.arith.env import ArithEnv

SETTINGS: dict[str, dict[str, bool]] = {
    "baseline": {"share_prefixes": False, "merge_lora": False},
    "merged": {"share_prefixes": False, "merge_lora": True},
    "shared": {"share_prefixes": True, "merge_lora": False},
    "both": {"share_prefixes": True, "merge_lora": True},
}

Decoded = list[list[tuple[int, float]]]
"""Per row, its (token, log-prob) pairs."""


def arith_prompts(engine: EmbeddedEngine, count: int) -> list[list[int]]:
    """The first prompts of `count` held-out Arith-v0 tasks, as the proxy encodes them."""
    env = ArithEnv(split="test")
    prompts = []
    for task_id in env.task_ids()[:count]:
        messages, info = env.reset(options={"task_id": task_id})
        prompts.append(engine.encode(messages, info["tools"]))
    return prompts


def random_adapter(model: str, rank: int, path: Path) -> str:
    """A LoRA adapter of the learner's shape with random non-zero weights, saved at `path`."""
    base, _ = models.load(model)
    torch.manual_seed(0)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=list(PROJECTIONS), init_lora_weights=False
    )
    get_peft_model(base, config).save_pretrained(path)
    return str(path)


def decode(engine: EmbeddedEngine, prompts: list[list[int]], tokens: int) -> tuple[Decoded, float]:
    """Every prompt queued at once on the policy, greedy, `tokens` each; the rows' tokens and
    the seconds until the last one ended."""
    sampling = SamplingParams(temperature=0.0, max_tokens=tokens)
    started = time.perf_counter()

    def submit() -> list[queue.SimpleQueue[Any]]:
        queues: list[queue.SimpleQueue[Any]] = []
        for ids in prompts:
            events: queue.SimpleQueue[Any] = queue.SimpleQueue()
            engine._scheduler.submit(ids, sampling, tokens, None, True, events)
            queues.append(events)
        return queues

    rows: Decoded = []
    for events in engine._scheduler.call(submit):  # one prefill for all of them
        row = []
        while (item := events.get(timeout=600)) is not END:
            if isinstance(item, BaseException):
                raise item
            row.append((item[0], item[1]))
        rows.append(row)
    return rows, time.perf_counter() - started


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as scratch:
        adapter = random_adapter(args.model, args.rank, Path(scratch) / "adapter")
        engines = {}
        for name, flags in SETTINGS.items():
            engine = EmbeddedEngine(
                args.model,
                max_batch=args.rows,
                share_prefixes=flags["share_prefixes"],
                merge_lora=flags["merge_lora"],
            )
            engine._scheduler.eos_ids = set()  # every row decodes `--tokens` tokens
            engine.load_adapter(adapter, 1)
            engines[name] = engine
        prompts = arith_prompts(engines["baseline"], args.rows)
        rates: dict[str, list[float]] = {name: [] for name in SETTINGS}
        decoded: dict[str, Decoded] = {}
        try:
            for engine in engines.values():
                decode(engine, prompts, args.tokens)  # uncounted: fills the prefix cache
            for _ in range(args.rounds):
                for name, engine in engines.items():
                    decoded[name], seconds = decode(engine, prompts, args.tokens)
                    rates[name].append(args.rows * args.tokens / seconds)
        finally:
            for engine in engines.values():
                engine.close()
    base = statistics.median(rates["baseline"])
    rows = []
    for name in SETTINGS:
        pairs = list(zip(decoded[name], decoded["baseline"], strict=True))
        same = all([t for t, _ in ours] == [t for t, _ in theirs] for ours, theirs in pairs)
        gap = max(
            abs(a[1] - b[1]) for ours, theirs in pairs for a, b in zip(ours, theirs, strict=False)
        )
        rate = statistics.median(rates[name])
        rows.append(
            {
                "setting": name,
                "tokens_per_s": round(rate, 1),
                "rates": [round(r, 1) for r in rates[name]],
                "ratio": round(rate / base, 3),
                "same_tokens": same,
                "max_dlogp": gap,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=64, help="prompts decoded together")
    parser.add_argument("--tokens", type=int, default=48, help="tokens each row decodes")
    parser.add_argument("--rounds", type=int, default=3, help="turns each setting takes")
    parser.add_argument("--rank", type=int, default=16, help="the adapter's LoRA rank")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    rows = measure(args)
    table = Table(
        title=f"embedded decode, {args.model}: {args.rows} Arith-v0 prompts x {args.tokens} "
        f"tokens, torch threads {torch.get_num_threads()}, median of {args.rounds}"
    )
    for column in ("setting", "tokens/s", "rounds", "ratio", "same tokens", "max |dlogp|"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["setting"],
            f"{row['tokens_per_s']:.1f}",
            " ".join(f"{r:.0f}" for r in row["rates"]),
            f"{row['ratio']:.2f}x",
            str(row["same_tokens"]),
            f"{row['max_dlogp']:.1e}",
        )
    Console().print(table)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
