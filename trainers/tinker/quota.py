"""Each owner's disk use by named checkpoints (`weights/NAME`, `sampler_weights/NAME` in any of
the owner's runs), held under a count and a byte cap (`max_checkpoints`,
`max_checkpoint_bytes` in `TinkerLimits`).

A save is checked twice: when it is asked for (the route answers 403 at once where the owner
already holds the most they may), and on the worker, after the checkpoint is written in its
staging folder and before it is moved into place, against its real size (the future fails
with a `user` error, the staging folder removed). A save under a name the run already holds
replaces that checkpoint, so it is counted in place of it. Deleting a checkpoint frees its
count and bytes at once: use is read from disk, so a restarted server counts the same.
Snapshots for sampling (no name) are not counted: they go when their session closes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainers.tinker.checkpoints import KINDS, RUN_RECORD, folder_bytes, run_owner
from trainers.tinker.errors import QuotaExceeded
from trainers.tinker.limits import TinkerLimits


@dataclass(frozen=True)
class Usage:
    """An owner's named checkpoints on disk."""

    count: int
    bytes: int


def usage(run_dir: Path, owner: str, leaving_out: Path | None = None) -> Usage:
    """What `owner`'s named checkpoints hold, but for `leaving_out` (one being replaced)."""
    count = size = 0
    for record in run_dir.glob(f"*/{RUN_RECORD}"):
        if run_owner(run_dir, record.parent.name.replace("_", ":")) != owner:
            continue
        for kind in KINDS:
            for config in (record.parent / kind).glob("*/adapter_config.json"):
                if config.parent != leaving_out:
                    count, size = count + 1, size + folder_bytes(config.parent)
    return Usage(count, size)


def check_room(
    run_dir: Path, owner: str, limits: TinkerLimits, target: Path, adding: int = 1
) -> None:
    """Whether `owner` may write a checkpoint of `adding` bytes at `target`.

    Raises:
        QuotaExceeded: it would take the owner past either cap.
    """
    used = usage(run_dir, owner, leaving_out=target)
    if used.count + 1 > limits.max_checkpoints:
        raise QuotaExceeded(
            f"this key's user holds {used.count} named checkpoints, the most it may "
            f"(tinker.limits.max_checkpoints={limits.max_checkpoints}); delete some first"
        )
    if used.bytes + adding > limits.max_checkpoint_bytes:
        raise QuotaExceeded(
            f"this key's user's named checkpoints hold {used.bytes} bytes; "
            f"{'this one would take them past' if adding > 1 else 'that is'} "
            f"tinker.limits.max_checkpoint_bytes={limits.max_checkpoint_bytes}; delete some first"
        )
