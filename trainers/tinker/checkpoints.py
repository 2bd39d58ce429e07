"""Tinker checkpoints on disk: `tinker://<model id>/<kind>/<name>` is the directory
run_dir/<model id>/<kind>/<name>, kind `weights` (save_state: the LoRA adapter and the Adam
state) or `sampler_weights` (the adapter only). Paths resolve from disk, so a restarted
server still serves the checkpoints of earlier runs in the same run directory.
"""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import torch

from trainers.learner import Learner
from trainers.tinker.errors import NotFound, UserError

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


RUN_RECORD = "run.json"
"""Each training client's record in its directory: its model id (the directory name is a
slug of it), base model and LoRA shape, so the REST routes list runs from disk."""
CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler"}
"""A tinker:// path's kind segment -> the REST API's checkpoint_type."""


def write_run_record(
    run_dir: Path, model_id: str, base_model: str, rank: int, attn: bool, mlp: bool
) -> None:
    """Records a training client (once: a record already there is kept)."""
    target = run_dir / model_slug(model_id) / RUN_RECORD
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    record = {"model_id": model_id, "base_model": base_model, "lora_rank": rank}
    record |= {"train_attn": attn, "train_mlp": mlp, "train_unembed": False}
    partial = target.with_suffix(".partial")
    partial.write_text(json.dumps(record))
    partial.replace(target)


def _record(run_dir: Path, model_id: str) -> tuple[Path, dict]:
    """A training run's directory and record.

    Raises:
        NotFound: no training run with that id in the run directory.
    """
    found = run_dir / model_slug(check_name(model_id))
    record_file = found / RUN_RECORD
    if not record_file.exists():
        raise NotFound(f"no training run {model_id!r}")
    return found, json.loads(record_file.read_text())


def _stamp(path: Path) -> str:
    return datetime.fromtimestamp(path.stat().st_mtime, tz=UTC).isoformat()


def checkpoint_list(run_dir: Path, model_id: str) -> list[dict]:
    """The run's checkpoints as the REST API describes them, oldest first."""
    found, _ = _record(run_dir, model_id)
    listed = []
    for kind, checkpoint_type in CHECKPOINT_TYPES.items():
        for folder in (found / kind).glob("*/adapter_config.json"):
            folder = folder.parent
            listed.append(
                {
                    "checkpoint_id": f"{kind}/{folder.name}",
                    "checkpoint_type": checkpoint_type,
                    "time": _stamp(folder),
                    "tinker_path": tinker_path(model_id, kind, folder.name),
                    "size_bytes": sum(f.stat().st_size for f in folder.iterdir() if f.is_file()),
                }
            )
    return sorted(listed, key=lambda c: c["time"])


def training_run(run_dir: Path, model_id: str) -> dict:
    """The run as the REST API's TrainingRun describes it."""
    found, record = _record(run_dir, model_id)
    listed = checkpoint_list(run_dir, model_id)

    def last(checkpoint_type: str) -> dict | None:
        return next((c for c in reversed(listed) if c["checkpoint_type"] == checkpoint_type), None)

    stamps = [_stamp(found), *(c["time"] for c in listed)]
    return {
        "training_run_id": record["model_id"],
        "base_model": record["base_model"],
        "model_owner": "local",
        "is_lora": True,
        "lora_rank": record["lora_rank"],
        "last_request_time": max(stamps),
        "last_checkpoint": last("training"),
        "last_sampler_checkpoint": last("sampler"),
    }


def training_runs(run_dir: Path) -> list[dict]:
    """Every recorded run in the run directory, most recently active first."""
    ids = [json.loads(record.read_text())["model_id"] for record in run_dir.glob(f"*/{RUN_RECORD}")]
    runs = [training_run(run_dir, model_id) for model_id in ids]
    return sorted(runs, key=lambda r: r["last_request_time"], reverse=True)


def weights_info(run_dir: Path, path: str) -> dict:
    """What a checkpoint holds: its base model and LoRA shape (the REST API's
    WeightsInfoResponse)."""
    directory(run_dir, path)  # refuses a malformed path or a missing checkpoint
    _, record = _record(run_dir, path.removeprefix("tinker://").split("/")[0])
    keys = ("base_model", "lora_rank", "train_attn", "train_mlp", "train_unembed")
    return {"is_lora": True} | {key: record[key] for key in keys}


def delete(run_dir: Path, model_id: str, checkpoint_id: str) -> Path:
    """Removes a checkpoint (`weights/NAME` or `sampler_weights/NAME`); returns its directory.

    Raises:
        NotFound: no such checkpoint.
    """
    kind, _, name = checkpoint_id.partition("/")
    try:
        found = directory(run_dir, tinker_path(model_id, kind, name))
    except UserError as error:
        raise NotFound(str(error)) from error
    shutil.rmtree(found)
    return found
