"""Aggregate generation throughput of each engine against plain transformers, on
`smollm2-135m`: the second table of `python -m benchmarks.perf.serving` (`--only throughput`).

Plain transformers `generate`, one request at a time (the baseline), the embedded engine,
vLLM called directly and vLLM through the proxy (served from a thread of this process),
each at 1 and 16 concurrent requests (vLLM's two alternated `--repeats` times, the median
kept); `ratio` is tokens/s over the baseline's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
from rich.table import Table

from agents import models
from agents.engines.base import Engine, SamplingParams
from agents.engines.embedded import EmbeddedEngine
from agents.engines.openai_http import KEEPALIVE_S
from agents.store import Store

TOPICS = ["the sea", "a robot", "winter", "a city", "a cat", "the moon", "music", "a forest"]


def prompts(count: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}."}]
        for i in range(count)
    ]


def aggregate(
    run_one: Callable[[list[dict[str, str]]], int], concurrency: int, count: int
) -> float:
    """Tokens/s over `count` requests, `concurrency` at a time."""
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(run_one, prompts(count)))
    return tokens / (time.perf_counter() - started)


def transformers_one(model: Any, tokenizer: Any, tokens: int) -> Callable[[Any], int]:
    lock = threading.Lock()  # the baseline serves one request at a time

    def run(messages: list[dict[str, str]]) -> int:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with lock, torch.inference_mode():
            out = model.generate(
                **ids, max_new_tokens=tokens, do_sample=True, temperature=1.0, top_p=1.0, top_k=0
            )
        return int(out.shape[1] - ids["input_ids"].shape[1])

    return run


def engine_one(engine: Engine, tokens: int) -> Callable[[Any], int]:
    sampling = SamplingParams(temperature=1.0, max_tokens=tokens)
    return lambda messages: len(engine.generate(messages, sampling=sampling).completion_token_ids)


def proxy_one(client: httpx.Client, base: str, tokens: int) -> Callable[[Any], int]:
    """One request through the proxy on a client kept open, as the engine keeps its own:
    a fresh `httpx.post` builds a client (and an SSL context) each time, tens of ms of
    CPU under the GIL that staggered 16 concurrent requests by a quarter of their time."""

    def run(messages: list[dict[str, str]]) -> int:
        body = {"model": "policy", "messages": messages, "max_tokens": tokens, "temperature": 1.0}
        response = client.post(base + "/v1/chat/completions", json=body)
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"])

    return run


def throughput_rows(args: argparse.Namespace) -> list[tuple[str, int, float | str]]:
    """(engine, concurrency, tokens/s or why not measured) on smollm2-135m."""
    rows: list[tuple[str, int, float | str]] = []
    model, tokenizer = models.load("smollm2-135m")
    torch.set_num_threads(args.threads)
    run = transformers_one(model, tokenizer, args.tokens)
    for concurrency in (1, 16):
        count = 6 if concurrency == 1 else 16
        rows.append(
            (
                "transformers generate, one at a time",
                concurrency,
                aggregate(run, concurrency, count),
            )
        )
    del model
    engine = EmbeddedEngine("smollm2-135m", threads=args.threads)
    for concurrency in (1, 16):
        count = 6 if concurrency == 1 else 16
        rows.append(
            (
                "embedded engine",
                concurrency,
                aggregate(engine_one(engine, args.tokens), concurrency, count),
            )
        )
    engine.close()
    del engine
    rows += vllm_rows(args)
    return rows


def vllm_rows(args: argparse.Namespace) -> list[tuple[str, int, float | str]]:
    if args.skip_vllm:
        return [(name, c, "skipped") for name in ("vLLM direct", "vLLM via proxy") for c in (1, 16)]
    try:
        from agents.engines.vllm import VLLMEngine

        engine = VLLMEngine("smollm2-135m")
    except Exception as error:  # no vLLM environment here: say so in the table
        reason = f"unavailable: {str(error).splitlines()[0][:60]}"
        return [(name, c, reason) for name in ("vLLM direct", "vLLM via proxy") for c in (1, 16)]
    from agents.serving.server import in_thread

    rows: list[tuple[str, int, float | str]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp, Store(Path(tmp) / "s.sqlite") as store:
            # Idle connections dropped before the proxy's uvicorn closes them (after 5 s).
            limits = httpx.Limits(keepalive_expiry=KEEPALIVE_S)
            with (
                in_thread(engine, store) as (url, _),
                httpx.Client(timeout=600, limits=limits) as client,
            ):
                direct_one = engine_one(engine, args.tokens)
                proxied_one = proxy_one(client, url.removesuffix("/v1"), args.tokens)
                for concurrency in (1, 16):
                    count = 6 if concurrency == 1 else 16
                    # Alternated, median of several: one pass of 16 requests is a single
                    # batch, and its tokens/s moves by 20% from one pass to the next here.
                    direct, proxied = [], []
                    for _ in range(args.repeats):
                        direct.append(aggregate(direct_one, concurrency, count))
                        proxied.append(aggregate(proxied_one, concurrency, count))
                    rows += [
                        ("vLLM direct", concurrency, statistics.median(direct)),
                        ("vLLM via proxy", concurrency, statistics.median(proxied)),
                    ]
    finally:
        engine.close()
    return rows


def throughput_table(args: argparse.Namespace) -> Table:
    rows = throughput_rows(args)
    baseline = {c: v for name, c, v in rows if name.startswith("transformers")}
    table = Table(
        title=f"smollm2-135m aggregate tokens/s ({args.tokens} tokens a request, "
        f"{args.threads} threads)"
    )
    for column in ("engine", "concurrent", "tokens/s", "ratio"):
        table.add_column(column, justify="left" if column == "engine" else "right")
    for name, concurrency, value in rows:
        base = baseline.get(concurrency)
        if isinstance(value, str):
            table.add_row(name, str(concurrency), value, "")
            continue
        ratio = f"{value / base:.2f}x" if isinstance(base, float) else ""
        table.add_row(name, str(concurrency), f"{value:.1f}", ratio)
        direct = next((v for n, c, v in rows if n == "vLLM direct" and c == concurrency), None)
        if name == "vLLM via proxy" and isinstance(direct, float):
            table.add_row(
                "  via proxy / direct (target >= 0.95x)", "", "", f"{value / direct:.2f}x"
            )
    return table
