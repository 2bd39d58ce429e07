"""Trajectory store throughput: committed turns per second, each commit durable against a
crash of the writer, against SQLite's default rollback journal as the baseline.

    python -m benchmarks.perf.store [--turns 2000] [--tokens 512]

Prints one table; `ratio` is turns/s over the baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from agents.store import Store
from agents.store_images import ImageFiles
from agents.store_rows import INSERT_TURN, turn_values
from agents.trajectory import Session, Turn, TurnType


def make_turn(session_id: str, index: int, tokens: int) -> Turn:
    return Turn(
        session_id=session_id,
        index=index,
        turn_type=TurnType.MAIN,
        prompt_messages=({"role": "user", "content": "x" * 200},),
        prompt_token_ids=tuple(range(tokens)),
        completion_token_ids=tuple(range(tokens // 4)),
        completion_logprobs=tuple(-0.5 for _ in range(tokens // 4)),
        completion={"role": "assistant", "content": "y" * 100},
        policy_version=0,
    )


def store_writes(path: Path, turns: int, tokens: int, threads: int, synchronous: str) -> float:
    """Seconds for `threads` writers to commit `turns` turns in all through one Store."""
    store = Store(path, synchronous=synchronous)  # type: ignore[arg-type]
    per_thread = turns // threads

    def write(worker: int) -> None:
        store.add_session(Session(f"s{worker}", "bench"))
        for index in range(per_thread):
            store.add_turn(make_turn(f"s{worker}", index, tokens))

    started = time.perf_counter()
    workers = [threading.Thread(target=write, args=(w,)) for w in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    store.close()
    return elapsed


def rollback_journal_writes(path: Path, turns: int, tokens: int) -> float:
    """The baseline: the same rows, one commit each, in SQLite's default journal mode."""
    Store(path).close()  # the store's own schema, migrated to the current version
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=DELETE")
    db.execute("INSERT INTO sessions VALUES ('s', 'bench', NULL, NULL, NULL, 'open', 0, '{}')")
    started = time.perf_counter()
    for index in range(turns):
        db.execute(
            INSERT_TURN,
            turn_values(make_turn("s", index, tokens), ImageFiles(path.with_suffix(".images"))),
        )
    elapsed = time.perf_counter() - started
    db.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=512, help="prompt tokens per turn")
    args = parser.parse_args()
    cases: list[tuple[str, Callable[[Path], float]]] = [
        (
            "sqlite default journal, 1 writer (baseline)",
            lambda p: rollback_journal_writes(p, args.turns, args.tokens),
        ),
        (
            "store WAL/NORMAL, 1 writer",
            lambda p: store_writes(p, args.turns, args.tokens, 1, "NORMAL"),
        ),
        (
            "store WAL/NORMAL, 4 writer threads",
            lambda p: store_writes(p, args.turns, args.tokens, 4, "NORMAL"),
        ),
        ("store WAL/FULL, 1 writer", lambda p: store_writes(p, args.turns, args.tokens, 1, "FULL")),
    ]
    table = Table(
        title=f"store: {args.turns} turns of {args.tokens} prompt tokens, one commit each"
    )
    for column in ("case", "turns/s", "ms/turn", "ratio"):
        table.add_column(column, justify="right" if column != "case" else "left")
    baseline = None
    with tempfile.TemporaryDirectory() as tmp:
        for number, (name, case) in enumerate(cases):
            rate = args.turns / case(Path(tmp) / f"case{number}.sqlite")
            baseline = baseline or rate
            table.add_row(name, f"{rate:,.0f}", f"{1000 / rate:.3f}", f"{rate / baseline:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
