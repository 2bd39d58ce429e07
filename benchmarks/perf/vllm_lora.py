"""vLLM on a CPU with a LoRA adapter on: vLLM's own PyTorch LoRA kernels (the baseline)
against clawgym's (`agents/engines/vllm_plugin`), in one run.

    python -m benchmarks.perf.vllm_lora [--model smollm2-135m] [--cores 2] [--tokens 64]
        [--concurrency 1 16 32]

Each kernel set gets a vLLM server of its own (`VLLM_PLUGINS=""` turns clawgym's plugin
off for the baseline: vLLM's own switch), serving a random rank-16 adapter on every
projection, the learner's default shape, published twice as the trainer publishes versions
(so the policy sits in vLLM's last adapter slot, as every other version does). Figures:

- decode tokens/s: completion tokens over wall time, `--concurrency` policy requests at a
  time, each sampling up to `--tokens` tokens;
- base rows' log-prob gap: requests with the adapter off (a self-judge's, a teacher's)
  decoded in the same batch as policy requests, against the embedded engine scoring the
  same ids with the adapter off; the baseline's kernels apply the last slot's adapter to
  them. The policy rows' gap, against the embedded engine with the adapter on, is beside it.

The embedded engine's tokens/s on the same cores is a reference row. Ratios are clawgym's
over the baseline's.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from agents import models
from agents.config import PROJECTIONS
from agents.engines.base import BASE, POLICY, Completion, Engine, SamplingParams
from agents.engines.embedded import EmbeddedEngine
from benchmarks.perf.throughput import aggregate, engine_one, prompts

logger = logging.getLogger(__name__)

KERNELS = {"vLLM's own (baseline)": "", "clawgym's": None}
"""Kernel set -> VLLM_PLUGINS for its server ("" loads no plugin; None: every installed one)."""


@dataclass(frozen=True)
class Measured:
    """One engine's figures."""

    name: str
    tokens_per_s: dict[int, float]
    base_gap: float | None = None
    policy_gap: float | None = None


def decode_rate(engine: Engine, concurrency: int, tokens: int) -> float:
    """Completion tokens/s of `max(concurrency, 4)` policy requests, `concurrency` at a time."""
    return aggregate(engine_one(engine, tokens), concurrency, max(concurrency, 4))


def mixed_batch(engine: Engine, pairs: int, tokens: int) -> tuple[list[Completion], ...]:
    """`pairs` policy and `pairs` base requests sent together (greedy): (policy, base)."""
    sampling = SamplingParams(temperature=0.0, max_tokens=tokens)
    adapters = [POLICY, BASE] * pairs
    with ThreadPoolExecutor(len(adapters)) as pool:
        done = list(
            pool.map(
                lambda job: engine.generate(job[0], sampling=sampling, adapter=job[1]),
                zip(prompts(len(adapters)), adapters, strict=True),
            )
        )
    return done[0::2], done[1::2]


def worst_gap(
    reference: EmbeddedEngine, completions: Sequence[Completion], adapter: str | None
) -> float:
    """The largest |engine - reference| log-prob over every completion token."""
    gaps = [
        abs(ours - theirs)
        for c in completions
        for ours, theirs in zip(
            c.completion_logprobs,
            reference.score(c.prompt_token_ids, c.completion_token_ids, adapter=adapter),
            strict=True,
        )
    ]
    return max(gaps)


def save_adapter(model: str, path: Path) -> Path:
    """A random rank-16 adapter on every projection (non-zero B: it changes the outputs)."""
    from peft import LoraConfig, get_peft_model

    base, _ = models.load(model)
    torch.manual_seed(0)
    config = LoraConfig(
        r=16, lora_alpha=32, target_modules=list(PROJECTIONS), init_lora_weights=False
    )
    get_peft_model(base, config).save_pretrained(path)
    return path


@contextmanager
def plugins(allowed: str | None) -> Iterator[None]:
    """VLLM_PLUGINS set (or unset) for the servers started inside."""
    before = os.environ.pop("VLLM_PLUGINS", None)
    if allowed is not None:
        os.environ["VLLM_PLUGINS"] = allowed
    try:
        yield
    finally:
        os.environ.pop("VLLM_PLUGINS", None)
        if before is not None:
            os.environ["VLLM_PLUGINS"] = before


def measure_vllm(
    name: str, allowed: str | None, adapter: Path, reference: EmbeddedEngine, args
) -> Measured:
    from agents.engines.vllm import VLLMEngine

    with plugins(allowed):
        engine = VLLMEngine(args.model, cpus=list(range(args.cores)), whole_prefills=True)
    try:
        for version in (1, 2):  # the second publish lands in the last of vLLM's two slots
            engine.load_adapter(str(adapter), version=version)
        decode_rate(engine, 4, 8)  # warm-up
        rates = {c: decode_rate(engine, c, args.tokens) for c in args.concurrency}
        policy, base = mixed_batch(engine, pairs=4, tokens=16)
    finally:
        engine.close()
    return Measured(
        name,
        rates,
        base_gap=worst_gap(reference, base, BASE),
        policy_gap=worst_gap(reference, policy, POLICY),
    )


def table(rows: Sequence[Measured], args: argparse.Namespace) -> Table:
    out = Table(
        title=f"vLLM on {args.cores} CPU core(s), {args.model} with a rank-16 LoRA adapter on, "
        f"{args.tokens} tokens a request"
    )
    out.add_column("kernels", justify="left")
    for c in args.concurrency:
        out.add_column(f"tokens/s at {c}", justify="right")
    out.add_column("base rows' gap (max)", justify="right")
    out.add_column("policy rows' gap (max)", justify="right")
    baseline = rows[0]
    for row in rows:
        cells = []
        for c in args.concurrency:
            ratio = (
                ""
                if row is baseline
                else f" ({row.tokens_per_s[c] / baseline.tokens_per_s[c]:.2f}x)"
            )
            cells.append(f"{row.tokens_per_s[c]:.1f}{ratio}")
        gaps = [_gap(row.base_gap), _gap(row.policy_gap)]
        out.add_row(row.name, *cells, *gaps)
    return out


def _gap(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--cores", type=int, default=2, help="cores vLLM computes on")
    parser.add_argument("--tokens", type=int, default=64, help="tokens a request")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    with tempfile.TemporaryDirectory() as scratch:
        adapter = save_adapter(args.model, Path(scratch) / "adapter")
        reference = EmbeddedEngine(args.model, threads=args.cores)
        reference.load_adapter(str(adapter), version=1)
        rows = [
            measure_vllm(name, allowed, adapter, reference, args)
            for name, allowed in KERNELS.items()
        ]
        embedded = {c: decode_rate(reference, c, args.tokens) for c in args.concurrency}
        rows.append(Measured("embedded engine, same cores (reference)", embedded))
        reference.close()
    Console(width=160).print(table(rows, args))


if __name__ == "__main__":
    main()
