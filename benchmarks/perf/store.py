"""Trajectory store throughput: committed turns per second, each commit durable against a
crash of the writer, against SQLite's default rollback journal as the baseline; and the
bytes a turn of a GUI episode on screenshots takes, with the store's content-addressed
images against the same rows with every image inline as a base64 data URL.

    python -m benchmarks.perf.store [--turns 2000] [--tokens 512] [--episodes 8]
                                    [--episode-turns 12]

Prints two tables; `ratio` is turns/s over the baseline measured in the same run, and the
inline rows' bytes per turn over the content-addressed ones'. An episode's turn k holds the
history's k + 1 screenshots in its prompt and the next one in its next state, as GUI-v0's
`observation=screenshot` makes them: synthetic 160 x 210 PNGs of boxes and text, each
distinct, of about 6 KB (GUI-v0's MiniWoB pages shoot at 2.5-9 KB).
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import random
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw
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


def screenshot(seed: int) -> bytes:
    """A synthetic page screenshot, distinct per seed: boxes with text on white."""
    rng = random.Random(seed)
    image = Image.new("RGB", (160, 210), "white")
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x, y = rng.randrange(150), rng.randrange(200)
        fill = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
        draw.rectangle((x, y, x + rng.randrange(8, 60), y + rng.randrange(6, 20)), fill, "black")
        draw.text((x + 2, y + 2), "".join(rng.choice("abcdefgh ") for _ in range(8)), "black")
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def _view(image: bytes) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    parts = [{"type": "text", "text": "Task: click the button"}]
    return {"role": "user", "content": [*parts, {"type": "image_url", "image_url": {"url": url}}]}


def screenshot_episode(session_id: str, turns: int, seed: int) -> list[Turn]:
    """An episode's turns as GUI-v0 on screenshots leaves them: each prompt the whole
    history, a new screenshot after each reply."""
    views = [_view(screenshot(seed * 1000 + k)) for k in range(turns + 1)]
    reply = {"role": "assistant", "content": '{"name": "click_at", "arguments": {"x": 3}}'}
    history: list[dict[str, Any]] = [{"role": "system", "content": "Operate the page."}]
    episode = []
    for index in range(turns):
        history.append(views[index])
        turn = make_turn(session_id, index, 64)
        episode.append(
            turn.replace(
                prompt_messages=tuple(history), completion=reply, next_state=(views[index + 1],)
            )
        )
        history.append(reply)
    return episode


class InlineImages(ImageFiles):
    """The baseline: images stay in the rows, as base64 data URLs."""

    def stash(self, messages: Sequence[Any]) -> list[Any]:
        return list(messages)


def image_writes(path: Path, episodes: list[list[Turn]], inline: bool) -> tuple[float, int]:
    """Seconds to commit the episodes' turns (each commit its own, in WAL mode as the
    store commits), and the bytes they add: to the SQLite file, checkpointed, and in the
    images folder (the files' sizes, not the blocks they fill)."""
    Store(path).close()  # the store's own schema
    empty = os.path.getsize(path)
    images = (InlineImages if inline else ImageFiles)(path.with_name(path.name + ".images"))
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    started = time.perf_counter()
    for episode in episodes:
        db.execute(
            "INSERT INTO sessions VALUES (?, 'bench', NULL, NULL, NULL, 'open', 0, '{}')",
            (episode[0].session_id,),
        )
        for turn in episode:
            db.execute(INSERT_TURN, turn_values(turn, images))
    elapsed = time.perf_counter() - started
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    folder = images.folder
    stored = sum(f.stat().st_size for f in folder.iterdir()) if folder.exists() else 0
    return elapsed, os.path.getsize(path) - empty + stored


def image_table(episodes: int, turns: int, folder: Path) -> Table:
    """Bytes per turn of screenshot episodes, content-addressed against inline."""
    played = [screenshot_episode(f"e{n}", turns, n) for n in range(episodes)]
    count = episodes * turns
    table = Table(
        title=f"store: {episodes} GUI episodes of {turns} turns on screenshots, one commit each"
    )
    for column in ("case", "turns/s", "bytes/turn", "ratio"):
        table.add_column(column, justify="right" if column != "case" else "left")
    inline = image_writes(folder / "inline.sqlite", played, inline=True)
    addressed = image_writes(folder / "addressed.sqlite", played, inline=False)
    for name, (seconds, size) in (
        ("images inline as base64 data URLs (baseline)", inline),
        ("store: images by sha256 beside the file", addressed),
    ):
        table.add_row(
            name, f"{count / seconds:,.0f}", f"{size / count:,.0f}", f"{inline[1] / size:.2f}x"
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=512, help="prompt tokens per turn")
    parser.add_argument("--episodes", type=int, default=8, help="GUI episodes on screenshots")
    parser.add_argument("--episode-turns", type=int, default=12, help="turns per GUI episode")
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
        Console().print(image_table(args.episodes, args.episode_turns, Path(tmp)))


if __name__ == "__main__":
    main()
