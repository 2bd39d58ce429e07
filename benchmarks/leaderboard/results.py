"""The results store: one SQLite file that every benchmark invocation appends to.

Tables: `runs` (one row per invocation: suite, the exact resolved config, git commit),
`results` (a policy on a task set: `TaskSetResult` plus the task ids and seeds it played)
and `episodes` (every episode, with the trajectory-store session holding its turns). The
leaderboard shows, for each suite, task set and policy, the newest result, so two runs
into the same store compare side by side.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from benchmarks.leaderboard.evaluate import EpisodeRecord, TaskSetResult

# Field annotations are strings here (`from __future__ import annotations`).
_TYPES = {"int": "INTEGER", "float": "REAL", "bool": "INTEGER"}


def _columns(record: Any) -> str:
    return ", ".join(
        f"{f.name} {_TYPES.get(str(f.type).split(' ')[0], 'TEXT')}" for f in fields(record)
    )


_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, suite TEXT NOT NULL, started REAL NOT NULL, finished REAL,
    config TEXT NOT NULL, git TEXT
);
CREATE TABLE IF NOT EXISTS results (
    run_id TEXT NOT NULL, suite TEXT NOT NULL, {_columns(TaskSetResult)},
    task_ids TEXT NOT NULL, seeds TEXT NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (run_id, task_set, policy)
);
CREATE TABLE IF NOT EXISTS episodes (
    run_id TEXT NOT NULL, task_set TEXT NOT NULL, policy TEXT NOT NULL, {_columns(EpisodeRecord)}
);
"""


class ResultsStore:
    """Reads and writes the results store at `path` (created with its parents)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> ResultsStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start_run(self, run_id: str, suite: str, config: dict[str, Any], git: str | None) -> None:
        with self._db:
            self._db.execute(
                "INSERT INTO runs VALUES (?, ?, ?, NULL, ?, ?)",
                (run_id, suite, time.time(), json.dumps(config, sort_keys=True), git),
            )

    def finish_run(self, run_id: str) -> None:
        with self._db:
            self._db.execute("UPDATE runs SET finished = ? WHERE run_id = ?", (time.time(), run_id))

    def add_result(
        self,
        run_id: str,
        suite: str,
        result: TaskSetResult,
        episodes: Sequence[EpisodeRecord],
    ) -> None:
        """One result row and its episodes, in one transaction."""
        row = asdict(result)
        ids = sorted({e.task_id for e in episodes})
        seeds = [[e.task_id, e.sample, e.seed] for e in episodes]
        with self._db:
            self._db.execute(
                f"INSERT OR REPLACE INTO results VALUES ({', '.join('?' * (len(row) + 5))})",
                (run_id, suite, *row.values(), json.dumps(ids), json.dumps(seeds), time.time()),
            )
            width = len(fields(EpisodeRecord)) + 3
            self._db.executemany(
                f"INSERT INTO episodes VALUES ({', '.join('?' * width)})",
                [(run_id, result.task_set, result.policy, *asdict(e).values()) for e in episodes],
            )

    def latest(self, suites: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """The newest result of each (suite, task set, policy), as dicts with `run_id`."""
        rows = self._db.execute(
            """SELECT r.* FROM results r WHERE r.created = (
                   SELECT MAX(created) FROM results
                   WHERE suite = r.suite AND task_set = r.task_set AND policy = r.policy)
               ORDER BY r.suite, r.task_set, r.pass1 DESC, r.score DESC"""
        ).fetchall()
        return [dict(r) for r in rows if suites is None or r["suite"] in suites]

    def results(self, run_id: str) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT * FROM results WHERE run_id = ?", (run_id,)).fetchall()
        return [dict(r) for r in rows]

    def runs(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._db.execute("SELECT * FROM runs ORDER BY started")]

    def episodes(self, run_id: str) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT * FROM episodes WHERE run_id = ?", (run_id,)).fetchall()
        return [dict(r) for r in rows]
