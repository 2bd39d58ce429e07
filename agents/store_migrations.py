"""How an existing trajectory store is brought up to this clawgym's schema.

`agents.store` creates a new file with the first schema (version 1) and then runs every
migration, so that a new store and a migrated old one are the same. A migration is a step
from version n - 1 to n: a few SQL statements (columns are added, never dropped or renamed,
so that a reader keeps what it had). All the steps a store needs run in one transaction
that holds the write lock: a store that several processes open at once is migrated once,
and a crash leaves it at its old version, still readable.

To change the schema, add the next step to `MIGRATIONS`; a store newer than the code is
refused rather than misread.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

MIGRATIONS: dict[int, tuple[str, ...]] = {
    # Each turn's top-k ids and log-probs under the policy that sampled it (the top-k
    # methods' S_t): k int32 ids and k float64 log-probs per completion token, NULL if none.
    2: (
        "ALTER TABLE turns ADD COLUMN completion_top_ids BLOB",
        "ALTER TABLE turns ADD COLUMN completion_top_logprobs BLOB",
    ),
    # The judge's hint candidates of each turn and, where the learner chose among them by
    # overlap, their overlap scores: JSON lists, NULL before a judgement.
    3: (
        "ALTER TABLE turns ADD COLUMN hint_candidates TEXT",
        "ALTER TABLE turns ADD COLUMN hint_overlaps TEXT",
    ),
}
FIRST_VERSION = 1
"""The version `agents.store`'s creation script makes."""
SCHEMA_VERSION = max(MIGRATIONS, default=FIRST_VERSION)
"""The version this code reads and writes."""


def migrate(db: sqlite3.Connection, path: Path) -> int:
    """Runs the steps from the store's version to `SCHEMA_VERSION` on `db` (autocommit
    mode); returns the version the store had. Raises ValueError for a newer store."""
    db.execute("BEGIN IMMEDIATE")
    try:
        found = int(db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0])
        if found > SCHEMA_VERSION:
            raise ValueError(
                f"{path} has store schema {found}; this clawgym reads up to {SCHEMA_VERSION}: "
                "open it with a newer clawgym"
            )
        for version in range(found + 1, SCHEMA_VERSION + 1):
            for statement in MIGRATIONS[version]:
                db.execute(statement)
        db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
    return found
