"""Command line of clawgym's OpenEnv server.

    python -m envs.openenv serve clawgym/Terminal-v0 --port 8010 --kwargs '{"sandbox": "bwrap"}'

Binds 127.0.0.1 by default; `--host 0.0.0.0` needs a key, from `--api-key` or (kept out of
the process list) `$CLAWGYM_OPENENV_API_KEY`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from envs.openenv.limits import ServerLimits
from envs.openenv.server import LOOPBACK, serve

API_KEY_VARIABLE = "CLAWGYM_OPENENV_API_KEY"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envs.openenv")
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("serve", help="serve a clawgym env over OpenEnv")
    command.add_argument("env_id", help="a registered id, e.g. clawgym/Arith-v0")
    command.add_argument("--host", default=LOOPBACK)
    command.add_argument("--port", type=int, default=8010)
    command.add_argument("--kwargs", default="{}", help="the env's kwargs as a JSON object")
    command.add_argument("--api-key", default=os.environ.get(API_KEY_VARIABLE))
    defaults = ServerLimits()
    for name, kind, help_text in (
        ("max_sessions", int, "sessions open at once (503 past it)"),
        ("max_sessions_per_client", int, "sessions one key or address holds (429 past it)"),
        ("session_idle_s", float, "an HTTP-made session idle this long is closed"),
        ("websocket_idle_s", float, "a WebSocket that sends nothing this long is closed"),
        ("idle_timeout_s", float, "a connection idle this long is closed"),
        ("request_timeout_s", float, "a request must arrive within this long"),
    ):
        default = getattr(defaults, name)
        command.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=default,
            help=f"{help_text} ({default})",
        )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        env_kwargs = json.loads(args.kwargs)
        if not isinstance(env_kwargs, dict):
            raise ValueError(f"--kwargs must be a JSON object, got {args.kwargs}")
        serve(
            args.env_id,
            env_kwargs,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            limits=ServerLimits(
                max_sessions=args.max_sessions,
                max_sessions_per_client=args.max_sessions_per_client,
                session_idle_s=args.session_idle_s,
                websocket_idle_s=args.websocket_idle_s,
                idle_timeout_s=args.idle_timeout_s,
                request_timeout_s=args.request_timeout_s,
            ),
        )
    except ValueError as error:  # json's decode error is one too
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    sys.exit(main())
