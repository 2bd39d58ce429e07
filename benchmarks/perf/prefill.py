"""The embedded engine's prefill of requests that arrive together with very different amounts
left to compute: split into passes of similar widths (`agents.engines.batch.prefill_passes`,
the default) against one pass for all (the engine before the split), measured in the same run.

    .venv/bin/python -m benchmarks.perf.prefill [--model smollm2-135m] [--short 24]
        [--wide 8] [--tokens 16] [--rounds 3] [--out FILE.json]

The workload is the moment a new policy version is published while episodes are under way,
as in the main job while rollouts and an evaluation play together: held-out Arith-v0 tasks
play their first turn (uncounted), `--wide` of them on version v and `--short` on version
v+1 (a random adapter of the learner's shape, the same weights under both numbers); then
every task's second turn (its first prompt, its reply, a tool response) arrives at once on
version v+1. The `--short` tasks' first turns are in the prefix cache (about 25 tokens each
left to compute), the `--wide` ones' are another version's KV and are computed after the
system prompt (about 100). Each row then decodes `--tokens` tokens, greedy, end-of-sequence
ignored. Per setting (an engine each): the seconds until every row had its first token
(the prefill), until the last row ended, the prefill columns computed (tokens and
padding), and whether tokens and log-probs match the one-pass engine's. Settings take turns
`--rounds` times; medians are kept.
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
from rich.console import Console
from rich.table import Table

from agents.engines.base import SamplingParams
from agents.engines.batch import END
from agents.engines.embedded import EmbeddedEngine
from benchmarks.perf.decode import arith_prompts, random_adapter

SETTINGS = {"one pass": False, "passes": True}
"""Setting name: `split_prefills`."""

TOOL_RESPONSE = [{"role": "user", "content": "<tool_response>\n42\n</tool_response>"}]


def queue_all(
    engine: EmbeddedEngine, prompts: list[list[int]], tokens: int
) -> list[queue.SimpleQueue[Any]]:
    """Every prompt queued on the policy from the scheduler thread: they arrive together."""
    sampling = SamplingParams(temperature=0.0, max_tokens=tokens)

    def submit() -> list[queue.SimpleQueue[Any]]:
        queues: list[queue.SimpleQueue[Any]] = []
        for ids in prompts:
            events: queue.SimpleQueue[Any] = queue.SimpleQueue()
            engine._scheduler.submit(ids, sampling, tokens, None, True, events)
            queues.append(events)
        return queues

    return engine._scheduler.call(submit)


def drain(events: queue.SimpleQueue[Any]) -> list[tuple[int, float]]:
    row = []
    while (item := events.get(timeout=600)) is not END:
        if isinstance(item, BaseException):
            raise item
        row.append((item[0], item[1]))
    return row


def wave(
    engine: EmbeddedEngine, adapter: str, version: int, prompts: list[list[int]], args: Any
) -> dict[str, Any]:
    """One round of the workload on `engine`, publishing versions `version` and `version+1`."""
    wide, short = prompts[: args.wide], prompts[args.wide :]
    engine.load_adapter(adapter, version)
    replies = [drain(q) for q in queue_all(engine, wide, args.tokens)]
    engine.load_adapter(adapter, version + 1)
    replies += [drain(q) for q in queue_all(engine, short, args.tokens)]
    follow_up = engine.encode(TOOL_RESPONSE)
    seconds = [
        prompt + [token for token, _ in reply] + follow_up
        for prompt, reply in zip(prompts, replies, strict=True)
    ]
    computed = engine.prefill_counts()[2]
    started = time.perf_counter()
    queues = queue_all(engine, seconds, args.tokens)
    firsts = [q.get(timeout=600) for q in queues]
    prefilled = time.perf_counter() - started
    rows = [[(first[0], first[1]), *drain(q)] for first, q in zip(firsts, queues, strict=True)]
    return {
        "prefill_s": prefilled,
        "wave_s": time.perf_counter() - started,
        "columns": engine.prefill_counts()[2] - computed,
        "prompt_tokens": sum(len(ids) for ids in seconds),
        "rows": rows,
    }


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as scratch:
        adapter = random_adapter(args.model, 16, Path(scratch) / "adapter")
        engines = {
            name: EmbeddedEngine(args.model, max_batch=args.wide + args.short, split_prefills=split)
            for name, split in SETTINGS.items()
        }
        try:
            prompts = arith_prompts(engines["passes"], args.wide + args.short)
            for engine in engines.values():
                engine._scheduler.eos_ids = set()  # every row decodes `--tokens` tokens
            for round_ in range(args.rounds + 1):  # the first round is uncounted
                for name, engine in engines.items():
                    result = wave(engine, adapter, 1 + 2 * round_, prompts, args)
                    if round_:
                        runs[name].append(result)
        finally:
            for engine in engines.values():
                engine.close()
    base = runs["one pass"]
    table = []
    for name, results in runs.items():
        pairs = [
            (ours, theirs)
            for mine, other in zip(results, base, strict=True)
            for ours, theirs in zip(mine["rows"], other["rows"], strict=True)
        ]
        prefill = statistics.median(r["prefill_s"] for r in results)
        base_prefill = statistics.median(r["prefill_s"] for r in base)
        table.append(
            {
                "setting": name,
                "prefill_s": round(prefill, 2),
                "wave_s": round(statistics.median(r["wave_s"] for r in results), 2),
                "columns": results[-1]["columns"],
                "prompt_tokens": results[-1]["prompt_tokens"],
                "prefill_ratio": round(base_prefill / prefill, 3),
                "same_tokens": all([t for t, _ in a] == [t for t, _ in b] for a, b in pairs),
                "max_dlogp": max(
                    abs(x[1] - y[1]) for a, b in pairs for x, y in zip(a, b, strict=True)
                ),
            }
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--short", type=int, default=24, help="next turns whose KV is cached")
    parser.add_argument("--wide", type=int, default=8, help="next turns of an older version")
    parser.add_argument("--tokens", type=int, default=16, help="tokens each row decodes")
    parser.add_argument("--rounds", type=int, default=3, help="turns each setting takes")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    rows = measure(args)
    table = Table(
        title=f"embedded prefill, {args.model}: {args.short} cached + {args.wide} uncached "
        f"next turns arriving together, torch threads {torch.get_num_threads()}, "
        f"median of {args.rounds}"
    )
    columns = ("setting", "prefill s", "ratio", "wave s", "columns", "prompt tokens")
    for column in (*columns, "same tokens", "max |dlogp|"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["setting"],
            f"{row['prefill_s']:.2f}",
            f"{row['prefill_ratio']:.2f}x",
            f"{row['wave_s']:.2f}",
            str(row["columns"]),
            str(row["prompt_tokens"]),
            str(row["same_tokens"]),
            f"{row['max_dlogp']:.1e}",
        )
    Console().print(table)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
