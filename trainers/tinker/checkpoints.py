"""Tinker checkpoints on disk: `tinker://<model id>/<kind>/<name>` is the directory
run_dir/<model id>/<kind>/<name>, kind `weights` (save_state: the LoRA adapter and the Adam
state) or `sampler_weights` (the adapter only). Paths resolve from disk, so a restarted
server still serves the checkpoints of earlier runs in the same run directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trainers.learner import Learner
from trainers.tinker.errors import UserError

KINDS = ("weights", "sampler_weights")


def model_slug(model_id: str) -> str:
    """The model's directory name under the run directory."""
    return model_id.replace(":", "_").replace("/", "_")


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


def check_name(name: str) -> str:
    """`name` if it is one safe path segment.

    Raises:
        UserError: empty, hidden, or with a separator.
    """
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise UserError(f"bad checkpoint name {name!r}: use one path segment")
    return name


def directory(run_dir: Path, path: str) -> Path:
    """The directory of a saved `tinker://` checkpoint.

    Raises:
        UserError: not a tinker:// checkpoint path, or nothing saved there.
    """
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in KINDS:
        raise UserError(f"{path!r} is not a tinker://<model id>/<{'|'.join(KINDS)}>/<name> path")
    found = run_dir / model_slug(check_name(parts[0])) / parts[1] / check_name(parts[2])
    if not (found / "adapter_config.json").exists():
        raise UserError(f"no checkpoint at {path!r}")
    return found


def save_state(learner: Learner, kind: str, name: str) -> Path:
    """Writes the adapter (and, for `weights`, the optimiser state) under the learner's
    run directory; returns the directory."""
    target = learner.save_adapter(f"{kind}/{check_name(name)}")
    if kind == "weights":
        torch.save(learner.optimizer.state_dict(), target / "optimizer.pt")
    return target


def adapter_shape(found: Path) -> tuple[int, frozenset[str]]:
    """A saved adapter's LoRA rank and target modules."""
    config = json.loads((found / "adapter_config.json").read_text())
    return int(config["r"]), frozenset(config.get("target_modules") or ())


def load_state(learner: Learner, found: Path, optimizer: bool) -> None:
    """Loads a checkpoint's adapter (and Adam state, when asked) into `learner`.

    Raises:
        UserError: a different LoRA rank, or no optimiser state saved there.
    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    mine = learner.model.peft_config["default"]
    saved = adapter_shape(found)
    if saved != (mine.r, frozenset(mine.target_modules)):
        raise UserError(
            f"the checkpoint's LoRA (rank {saved[0]} on {sorted(saved[1])}) differs from this "
            f"model's (rank {mine.r} on {sorted(mine.target_modules)})"
        )
    if optimizer and not (found / "optimizer.pt").exists():
        raise UserError("that checkpoint holds no optimizer state (a sampler checkpoint?)")
    set_peft_model_state_dict(learner.model, load_file(found / "adapter_model.safetensors"))
    if optimizer:
        learner.optimizer.load_state_dict(torch.load(found / "optimizer.pt", weights_only=False))
