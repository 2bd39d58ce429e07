"""The trajectory store: one SQLite file per run, in WAL mode.

Every write is its own committed transaction, so a turn returned by `add_turn` survives a
crash of the writing process (SIGKILL included): readers reopen the file and find it.
Several threads (each gets its own connection) and several processes may write at once;
SQLite serialises the writers and `busy_timeout` makes them wait instead of failing.

`synchronous=NORMAL` (the default) survives any process crash; `FULL` also survives a
power cut at the cost of an fsync per commit.

Images in turns' messages are kept once each, content-addressed, in the folder
`<file>.images/` beside it (`agents.store_images`); turns read back carry them inline again.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from agents.store_images import ImageFiles
from agents.store_migrations import FIRST_VERSION, migrate
from agents.store_rows import (
    INSERT_TURN,
    export_features,
    export_row,
    hint_choice_values,
    pack_logprobs,
    session_from_row,
    to_json,
    turn_from_row,
    turn_values,
)
from agents.trajectory import Judgement, Session, SessionStatus, Turn, TurnStatus, TurnType

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    env_id TEXT NOT NULL,
    task_id TEXT,
    group_id TEXT,
    outcome_reward REAL,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    metadata TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS turns (
    -- Readers page by seq. Turns are never deleted, so the rowid (largest + 1) only
    -- counts up; AUTOINCREMENT would add a write to sqlite_sequence to every commit.
    seq INTEGER PRIMARY KEY,
    session_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    turn_type TEXT NOT NULL,
    prompt_messages TEXT NOT NULL,
    prompt_token_ids BLOB NOT NULL,
    completion_token_ids BLOB NOT NULL,
    completion_logprobs BLOB NOT NULL,
    completion TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    tools TEXT NOT NULL,
    next_state TEXT,
    env_reward REAL,
    votes TEXT,
    score REAL,
    hint TEXT,
    teacher_logprobs BLOB,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE (session_id, idx)
);
CREATE INDEX IF NOT EXISTS turns_by_status ON turns (status, seq);
CREATE INDEX IF NOT EXISTS sessions_by_group ON sessions (group_id);
"""


class Store:
    """Turns and sessions of one run in one SQLite file.

    Args:
        path: the database file; created with its schema if missing, brought up to this
            clawgym's schema if older (`agents.store_migrations`).
        synchronous: SQLite's durability level, "NORMAL" or "FULL" (see module docstring).
        busy_timeout_s: how long a writer waits for another writer's lock.
    """

    def __init__(
        self,
        path: str | Path,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        busy_timeout_s: float = 60.0,
    ):
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be 'NORMAL' or 'FULL', got {synchronous!r}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.images = ImageFiles(self.path.with_name(self.path.name + ".images"))
        """The turns' images, each once by its sha256, beside the file (`agents.store_images`)."""
        self._synchronous = synchronous
        self._busy_timeout_ms = int(busy_timeout_s * 1000)
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        self._db().executescript(_SCHEMA)  # idempotent; executescript commits on its own
        with self._write() as db:
            db.execute(
                "INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(FIRST_VERSION),)
            )
        migrate(self._db(), self.path)

    # -- connections ---------------------------------------------------------------------
    def _db(self) -> sqlite3.Connection:
        if self._closed:
            raise RuntimeError(f"store {self.path} is closed")
        db = getattr(self._local, "db", None)
        if db is None:
            # One connection per thread; check_same_thread is off only so close() can
            # close every thread's connection from the thread that owns the store.
            db = sqlite3.connect(
                self.path,
                isolation_level=None,
                timeout=self._busy_timeout_ms / 1000,
                check_same_thread=False,
            )
            db.execute(f"PRAGMA busy_timeout={self._busy_timeout_ms}")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={self._synchronous}")
            db.row_factory = sqlite3.Row
            self._local.db = db
            with self._lock:
                self._connections.append(db)
        return db

    def leave_checkpoints_to_others(self) -> None:
        """Writes from this thread never run a WAL checkpoint; whoever calls this runs
        `checkpoint` on another thread. (SQLite's automatic checkpoint runs inside the
        commit that fills the log, with an fsync: 7-13 ms every ~160 turns here, which
        must not land on the proxy's event loop.)"""
        self._db().execute("PRAGMA wal_autocheckpoint=0")

    def checkpoint(self) -> None:
        """Copies the write-ahead log into the database file, without waiting for readers
        or writers. SQLite starts the log over at the next write only when no write came
        during the checkpoint; `agents.serving.proxy` holds its writes for that."""
        self._db().execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

    def _write(self) -> _Transaction:
        return _Transaction(self._db())

    def close(self) -> None:
        """Closes every connection this store opened; idempotent."""
        with self._lock:
            self._closed = True
            for db in self._connections:
                db.close()
            self._connections.clear()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sessions ------------------------------------------------------------------------
    def add_session(self, session: Session) -> None:
        """Records a session (without its turns); an existing id is an error."""
        with self._write() as db:
            db.execute(
                "INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    session.session_id,
                    session.env_id,
                    session.task_id,
                    session.group_id,
                    session.outcome_reward,
                    str(session.status),
                    session.created_at,
                    json.dumps(dict(session.metadata)),
                ),
            )

    def finish_session(
        self,
        session_id: str,
        outcome_reward: float | None = None,
        status: SessionStatus = SessionStatus.DONE,
        reason: str | None = None,
    ) -> None:
        """Closes a session with its outcome reward, and why it ended (`reason`, kept in its
        metadata as `end_reason`: "terminated", "context", what failed). An `interrupted`
        session's turns not yet trained are dropped in the same transaction: they are never
        judged or trained (`SessionStatus` says why)."""
        with self._write() as db:
            found = db.execute(
                "UPDATE sessions SET status=?, outcome_reward=COALESCE(?, outcome_reward), "
                "metadata=CASE WHEN ? IS NULL THEN metadata "
                "ELSE json_set(metadata, '$.end_reason', ?) END WHERE session_id=?",
                (str(status), outcome_reward, reason, reason, session_id),
            ).rowcount
            if found and status == SessionStatus.INTERRUPTED:
                db.execute(
                    "UPDATE turns SET status=? WHERE session_id=? AND status IN (?, ?)",
                    (
                        str(TurnStatus.DROPPED),
                        session_id,
                        str(TurnStatus.COLLECTED),
                        str(TurnStatus.JUDGED),
                    ),
                )
        if not found:
            raise KeyError(f"no session {session_id!r} in {self.path}")

    def update_session_metadata(self, session_id: str, changes: Mapping[str, Any]) -> None:
        """Merges `changes` into a session's metadata (JSON merge-patch: a None value
        removes its key)."""
        with self._write() as db:
            found = db.execute(
                "UPDATE sessions SET metadata=json_patch(metadata, ?) WHERE session_id=?",
                (json.dumps(dict(changes)), session_id),
            ).rowcount
        if not found:
            raise KeyError(f"no session {session_id!r} in {self.path}")

    def session_status(self, session_id: str) -> SessionStatus:
        """A session's status, without reading its turns."""
        row = (
            self._db()
            .execute("SELECT status FROM sessions WHERE session_id=?", (session_id,))
            .fetchone()
        )
        if row is None:
            raise KeyError(f"no session {session_id!r} in {self.path}")
        return SessionStatus(row[0])

    def session(self, session_id: str) -> Session:
        """A session with all its turns, in order."""
        row = (
            self._db()
            .execute("SELECT * FROM sessions WHERE session_id=?", (session_id,))
            .fetchone()
        )
        if row is None:
            raise KeyError(f"no session {session_id!r} in {self.path}")
        turns = self._db().execute(
            "SELECT * FROM turns WHERE session_id=? ORDER BY idx", (session_id,)
        )
        return session_from_row(row, tuple(turn_from_row(t, self.images) for t in turns))

    def sessions(
        self, status: SessionStatus | None = None, session_ids: Iterable[str] | None = None
    ) -> list[Session]:
        """Sessions (without turns), oldest first, by status and / or id."""
        clauses, args = [], list[str]()
        if status is not None:
            clauses.append("status=?")
            args.append(str(status))
        if session_ids is not None:
            ids = list(session_ids)
            clauses.append(f"session_id IN ({', '.join('?' * len(ids))})" if ids else "0")
            args.extend(ids)
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = self._db().execute(f"SELECT * FROM sessions{where} ORDER BY created_at", args)
        return [session_from_row(r, ()) for r in rows]

    def group_sessions(self, group_ids: Iterable[str]) -> list[Session]:
        """Every session of the given groups (without turns)."""
        ids = list(group_ids)
        query = f"SELECT * FROM sessions WHERE group_id IN ({', '.join('?' * len(ids))})"
        return [session_from_row(r, ()) for r in self._db().execute(query, ids)] if ids else []

    # -- turns ---------------------------------------------------------------------------
    def add_turn(self, turn: Turn) -> int:
        """Commits a turn and returns its sequence number (a cursor for readers)."""
        # One statement is its own transaction (autocommit), which takes the write lock
        # as it starts: no BEGIN IMMEDIATE / COMMIT round trips. The proxy commits every
        # turn on its request's critical path, and those two cost a third of the write.
        cursor = self._db().execute(
            INSERT_TURN,
            turn_values(turn, self.images),
        )
        return int(cursor.lastrowid or 0)

    def set_next_state(
        self,
        session_id: str,
        index: int,
        next_state: Sequence[Any],
        env_reward: float | None = None,
    ) -> None:
        """Fills a turn's next state once the following messages arrive, with the
        environment's reward for the turn when there is one."""
        self._update_turn(
            session_id,
            index,
            "next_state=?, env_reward=COALESCE(?, env_reward)",
            (to_json(self.images.stash(next_state)), env_reward),
        )

    def set_env_rewards(self, session_id: str, rewards: Mapping[int, float]) -> None:
        """Records the environment's reward of each turn (by index), in one transaction."""
        with self._write() as db:
            db.executemany(
                "UPDATE turns SET env_reward=? WHERE session_id=? AND idx=?",
                [(float(r), session_id, int(i)) for i, r in rewards.items()],
            )

    def end_turns(self, keys: Iterable[tuple[str, int]]) -> None:
        """Gives the turns (session id, index) that nothing continued an empty next state,
        in one transaction; a turn that has a next state keeps it."""
        with self._write() as db:
            db.executemany(
                "UPDATE turns SET next_state='[]' "
                "WHERE session_id=? AND idx=? AND next_state IS NULL",
                list(keys),
            )

    def set_judgement(self, session_id: str, index: int, judgement: Judgement) -> None:
        """Records the judge's verdict and moves a collected turn to `judged`. A turn that
        left the pipeline meanwhile stays where it is: an `interrupted` session's turns are
        dropped when it ends, and a judge that read one just before must not bring it back
        to be trained."""
        self._update_turn(
            session_id,
            index,
            "votes=?, score=?, hint=?, teacher_logprobs=?, "
            "status=CASE WHEN status=? THEN ? ELSE status END, hint_candidates=?, "
            "hint_overlaps=?",
            (
                to_json(list(judgement.votes)),
                judgement.score,
                judgement.hint,
                pack_logprobs(judgement.teacher_logprobs),
                str(TurnStatus.COLLECTED),
                str(TurnStatus.JUDGED),
                *hint_choice_values(judgement),
            ),
        )

    def mark_trained(self, seqs: Iterable[int], status: TurnStatus = TurnStatus.TRAINED) -> None:
        """Moves turns to `trained` (or `dropped`), all in one transaction."""
        with self._write() as db:
            db.executemany(
                "UPDATE turns SET status=? WHERE seq=?", [(str(status), s) for s in seqs]
            )

    def _update_turn(
        self, session_id: str, index: int, assignments: str, values: tuple[Any, ...]
    ) -> None:
        with self._write() as db:
            found = db.execute(
                f"UPDATE turns SET {assignments} WHERE session_id=? AND idx=?",
                (*values, session_id, index),
            ).rowcount
        if not found:
            raise KeyError(f"no turn {session_id!r}/{index} in {self.path}")

    def turns(
        self,
        status: TurnStatus | None = None,
        turn_type: TurnType | None = None,
        after_seq: int = 0,
        limit: int | None = None,
        settled: bool = False,
    ) -> list[tuple[int, Turn]]:
        """Turns as (seq, turn) in commit order, filtered; `after_seq` pages through them.
        `settled`: only turns whose next state is known: filled in, or never to come (their
        session is no longer open)."""
        clauses, args = ["seq > ?"], list[int | str]([after_seq])
        if settled:
            clauses.append(
                "(next_state IS NOT NULL OR EXISTS (SELECT 1 FROM sessions s "
                "WHERE s.session_id = turns.session_id AND s.status != 'open'))"
            )
        if status is not None:
            clauses.append("status = ?")
            args.append(str(status))
        if turn_type is not None:
            clauses.append("turn_type = ?")
            args.append(str(turn_type))
        query = f"SELECT * FROM turns WHERE {' AND '.join(clauses)} ORDER BY seq"
        if limit is not None:
            query += f" LIMIT {int(limit)}"
        return [
            (int(r["seq"]), turn_from_row(r, self.images)) for r in self._db().execute(query, args)
        ]

    def count_turns(
        self, status: TurnStatus | None = None, turn_type: TurnType | None = None
    ) -> int:
        """How many turns the store holds (with a given status and / or type)."""
        clauses, args = [], []
        for column, value in (("status", status), ("turn_type", turn_type)):
            if value is not None:
                clauses.append(f"{column}=?")
                args.append(str(value))
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        return int(self._db().execute(f"SELECT COUNT(*) FROM turns{where}", args).fetchone()[0])

    # -- export --------------------------------------------------------------------------
    def iter_rows(self, status: TurnStatus | None = None) -> Iterator[dict[str, Any]]:
        """Flat rows, one per turn, joined with their session, for analysis and SFT."""
        query = (
            "SELECT t.seq, s.env_id, s.task_id, s.group_id, s.outcome_reward, t.* FROM turns t "
            "JOIN sessions s USING (session_id)"
        )
        args: tuple[Any, ...] = ()
        if status is not None:
            query, args = query + " WHERE t.status=?", (str(status),)
        for row in self._db().execute(query + " ORDER BY t.seq", args):
            yield export_row(row, self.images)

    def export_parquet(self, path: str | Path, status: TurnStatus | None = None) -> Path:
        """Writes the turns as a Hugging Face `datasets` parquet file; returns its path."""
        import datasets  # heavy: only exports need it

        rows = list(self.iter_rows(status))
        if not rows:
            raise ValueError(f"no turns to export from {self.path}")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list(rows, features=export_features()).to_parquet(str(target))
        return target


class _Transaction:
    """`BEGIN IMMEDIATE` ... `COMMIT`: takes the write lock up front, so two writers never
    deadlock upgrading a read lock, and rolls back on error."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")
