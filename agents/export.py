"""Exports a store's turns as a Hugging Face `datasets` parquet file (`Store.export_parquet`):
for analysis, for another run's supervised fine-tuning (`method=sft
sft.demonstrations=PATH`), or for any trainer that reads parquet.

    python -m agents.export runs/my-run                       # -> runs/my-run/turns.parquet
    python -m agents.export runs/my-run/store.sqlite --out turns.parquet --status trained

One row per turn, joined with its session: token ids, log-probs, messages, rewards, the
judge's votes, score, hint and teacher log-probs, the hint candidates and their overlap
scores, and (where the turn kept them: a top-k method's run, `serve.top_logprobs`) each
completion position's top-k ids and log-probs, `completion_top_ids` and
`completion_top_logprobs`, one list of k per position.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from agents.store import Store
from agents.trajectory import TurnStatus

logger = logging.getLogger(__name__)

STORE_FILE = "store.sqlite"
"""The store's file name in a run directory."""


def store_path(source: str | Path) -> Path:
    """The store file of `source`: a run directory or the file itself.

    Raises:
        ValueError: neither exists.
    """
    path = Path(source)
    if path.is_dir():
        path = path / STORE_FILE
    if not path.is_file():
        raise ValueError(f"no store at {path}: give a run directory or a store.sqlite file")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agents.export", description=__doc__)
    parser.add_argument("source", help="a run directory, or a store.sqlite file")
    parser.add_argument("--out", help="the parquet file (default: turns.parquet beside it)")
    parser.add_argument(
        "--status",
        choices=[str(s) for s in TurnStatus],
        help="only turns with this status (default: every turn)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = store_path(args.source)
        out = Path(args.out) if args.out else path.parent / "turns.parquet"
        with Store(path) as store:
            written = store.export_parquet(out, TurnStatus(args.status) if args.status else None)
    except ValueError as error:
        logger.error("%s", error)
        return 2
    logger.info("wrote %s", written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
