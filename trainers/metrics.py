"""Where a run's metrics go: `metrics.jsonl` always, TensorBoard always, W&B when
configured, and a live progress line on the terminal."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


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

    def write(self, step: int, row: dict[str, Any], env: str | None = None) -> None:
        """Records one step's metrics: the run's, or (with `env`) one env's, whose row
        carries `"env": name` and whose TensorBoard and W&B keys are `env/<name>/<key>`."""
        with open(self.path, "a") as handle:
            head = {"step": step} if env is None else {"step": step, "env": env}
            handle.write(json.dumps(head | row) + "\n")
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


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl, in order (the run's and each env's)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
