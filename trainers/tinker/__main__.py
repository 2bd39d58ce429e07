"""Serves the Tinker API on clawgym's CPU learner.

    python -m trainers.tinker --port 8020 --model tiny --run-dir runs/tinker

Loopback by default; on any other host an API key is required (--api-key or
$CLAWGYM_TINKER_API_KEY), which clients send as TINKER_API_KEY (the SDK wants a `tml-`
prefix). Clients point at it with TINKER_BASE_URL=http://127.0.0.1:8020.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import uvicorn

from agents.config import is_loopback
from trainers.tinker.app import build_app
from trainers.tinker.engine import TinkerEngine


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainers.tinker", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8020)
    parser.add_argument("--model", default="tiny", help="the base model served")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/tinker"))
    parser.add_argument("--api-key", default=os.environ.get("CLAWGYM_TINKER_API_KEY"))
    args = parser.parse_args(argv)
    if args.api_key is None and not is_loopback(args.host):
        parser.error(
            f"--host {args.host} is not loopback: set --api-key or $CLAWGYM_TINKER_API_KEY"
        )
    logging.basicConfig(level=logging.INFO)
    app = build_app(TinkerEngine(args.model, args.run_dir), args.api_key)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
