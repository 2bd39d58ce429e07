"""Where a run's metrics go: `metrics.jsonl` always, TensorBoard always, W&B when
configured, and a live progress line on the terminal.

`metrics.jsonl` is part of the run's durable record, beside the store and the checkpoints;
TensorBoard and W&B are views of it. The rule that keeps it whole across a kill:

- a step's records (its row and one per env) are built before its checkpoint and saved in
  it (the checkpoint cursor's `CHECKPOINT_KEY`), then appended to the file in one write,
  flushed and fsync'd, once the step is published (its `publish_ms` is measured then, and
  the publish must follow the checkpoint);
- on resume from the checkpoint of step N (`MetricsWriter.resume`), the file keeps only
  the records of steps up to N: a later step's records outlived its checkpoint (a power
  loss can undo the checkpoint's rename, never the fsync'd row), and the resumed run takes
  that step again and records it anew, so no step appears twice; and if step N has no row
  (the kill came between its checkpoint and its write), its records come back from the
  checkpoint. A torn last line (a crash mid-write) is dropped. A step's row is the one
  without an `env` key; evaluations (`eval_` rows, `trainers.evaluation`) are kept by the
  same rule and read back by the evaluator, which plays no step twice.

So after a resume the file holds each checkpointed step's records exactly once, and
`read_metrics` is the run's whole history, whichever process wrote each part.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "metrics"
"""The key of a step's records in its checkpoint's cursor."""

Record = dict[str, Any]
"""One line of metrics.jsonl: `step`, `env` for an env's row, and the figures."""


def record(step: int, row: Mapping[str, Any], env: str | None = None) -> Record:
    """The line of metrics.jsonl of one step's row: the run's, or (with `env`) one env's."""
    head: Record = {"step": step} if env is None else {"step": step, "env": env}
    return head | dict(row)


class MetricsWriter:
    """Appends one row per step to every configured sink.

    Args:
        run_dir: the run directory (metrics.jsonl and tensorboard/ go there).
        wandb_project: a W&B project name to log to as well; None to skip W&B.
    """

    def __init__(self, run_dir: Path, wandb_project: str | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.path = Path(run_dir) / "metrics.jsonl"
        self.tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        self.wandb: Any = None
        if wandb_project:
            import wandb  # optional: only runs that ask for W&B need it installed

            self.wandb = wandb.init(project=wandb_project, dir=str(run_dir))

    def write(self, step: int, row: Mapping[str, Any], env: str | None = None) -> None:
        """Records one step's metrics: the run's, or (with `env`) one env's, whose row
        carries `"env": name` and whose TensorBoard and W&B keys are `env/<name>/<key>`."""
        self.write_records([record(step, row, env)])

    def write_records(self, records: Sequence[Record]) -> None:
        """Appends `records` (see `record`) to metrics.jsonl in one write, on disk when this
        returns, then hands them to TensorBoard and W&B."""
        created = not self.path.exists()
        with open(self.path, "a") as handle:
            handle.write("".join(json.dumps(r) + "\n" for r in records))
            handle.flush()
            os.fsync(handle.fileno())
        if created:
            _fsync_dir(self.path.parent)
        for line in records:
            self._to_views(line)

    def resume(self, step: int, checkpointed: Sequence[Record]) -> list[Record]:
        """Makes metrics.jsonl the record of the first `step` steps, as the module docstring
        says: records past `step` and a torn line go, and `checkpointed` (the checkpoint's
        records of `step`) come back if the file lacks that step's row. Returns the file's
        records."""
        found, torn = _readable_lines(self.path)
        kept = [r for r in found if r["step"] <= step]
        restored = []
        if not any(r["step"] == step and "env" not in r for r in kept):
            restored = [r for r in checkpointed if r["step"] == step]
        if torn or restored or len(kept) < len(found):
            logger.info(
                "metrics.jsonl resumed at step %d: %d records past it and %d torn lines "
                "dropped, %d restored from its checkpoint",
                step,
                len(found) - len(kept),
                torn,
                len(restored),
            )
            _replace(self.path, kept + restored)
        return kept + restored

    def _to_views(self, line: Record) -> None:
        step, env = line["step"], line.get("env")
        row = {k: v for k, v in line.items() if k not in ("step", "env")}
        prefix = "" if env is None else f"env/{env}/"
        scalars = {
            prefix + key: value
            for key, value in row.items()
            if isinstance(value, int | float) and not isinstance(value, bool)
        }
        for key, value in scalars.items():
            self.tensorboard.add_scalar(key, value, step)
        self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(scalars if env is not None else row, step=step)

    def close(self) -> None:
        """Flushes and closes every sink; idempotent."""
        self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def read_metrics(run_dir: Path) -> list[Record]:
    """The rows of a run's metrics.jsonl, in order (the run's and each env's)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_rows(records: Sequence[Record]) -> list[Record]:
    """The run's row of each step (not the envs' rows, nor their evaluations)."""
    return [r for r in records if "env" not in r]


def _readable_lines(path: Path) -> tuple[list[Record], int]:
    """The records of `path` that parse, and how many lines did not (what a crash
    mid-write leaves at the end)."""
    if not path.exists():
        return [], 0
    records, torn = [], 0
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            torn += 1
    return records, torn


def _replace(path: Path, records: Sequence[Record]) -> None:
    """Rewrites `path` with `records` atomically: a crash leaves the old file or the new."""
    staging = path.with_name(path.name + ".tmp")
    with open(staging, "w") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in records))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, path)
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """Puts a file's creation or rename on disk (its directory entry, not its bytes)."""
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)
