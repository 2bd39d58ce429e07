"""Tinker checkpoints on disk: `tinker://<model id>/<kind>/<name>` is the directory
run_dir/<model id>/<kind>/<name>, kind `weights` (save_state: the LoRA adapter and the Adam
state) or `sampler_weights` (the adapter only). Paths resolve from disk, so a restarted
server still serves the checkpoints of earlier runs in the same run directory.

Names are checked here, once, by one rule for writing and reading: a model id is
`<session>:train:<n>` with letters, digits and `-` in the session (so its directory name,
`:` made `_`, maps back to one id), a checkpoint name letters, digits, `.`, `_`, `-` (not
first a `.`). A checkpoint is written in run_dir/<model>/staging/ and renamed into place;
snapshots (sampler weights without a name) go to run_dir/<model>/ephemeral/: neither folder
is a name a client can give. Each run's record names its owner (`owner`), and a run or
checkpoint of another owner reads as one that does not exist.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from agents.api_keys import KEYLESS_USER
from trainers.learner import Learner
from trainers.tinker.errors import NotFound, UserError

KINDS = ("weights", "sampler_weights")
LOCAL = KEYLESS_USER
"""The owner of every run on a server without keys (and of runs recorded before owners)."""
MODEL_ID = re.compile(r"[A-Za-z0-9-]{1,80}:train:[0-9]{1,9}")
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
STAGING, EPHEMERAL = "staging", "ephemeral"


def check_model_id(model_id: str) -> str:
    """`model_id` if it is one the server could have issued.

    Raises:
        NotFound: any other string (nothing can be stored under it).
    """
    if not isinstance(model_id, str) or not MODEL_ID.fullmatch(model_id):
        raise NotFound(f"unknown model_id {model_id!r}")
    return model_id


def model_slug(model_id: str) -> str:
    """The model's directory name under the run directory (one-to-one: ids hold no `_`)."""
    return check_model_id(model_id).replace(":", "_")


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


def check_name(name: Any) -> str:
    """`name` if it is a checkpoint name (`NAME`).

    Raises:
        UserError: anything else.
    """
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise UserError(
            f"bad checkpoint name {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "not starting with '.'"
        )
    return name


def directory(run_dir: Path, path: str, owner: str | None = None) -> Path:
    """The directory of a saved `tinker://` checkpoint (of `owner`'s runs, when given).

    Raises:
        UserError: not a tinker:// checkpoint path, or nothing saved there for `owner`.
    """
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in KINDS:
        raise UserError(f"{path!r} is not a tinker://<model id>/<{'|'.join(KINDS)}>/<name> path")
    missing = UserError(f"no checkpoint at {path!r}")
    if not MODEL_ID.fullmatch(parts[0]) or not NAME.fullmatch(parts[2]):
        raise missing
    found = run_dir / model_slug(parts[0]) / parts[1] / parts[2]
    if not (found / "adapter_config.json").exists():
        raise missing
    if owner is not None and run_owner(run_dir, parts[0]) != owner:
        raise missing
    return found


def save_state(
    learner: Learner,
    kind: str,
    name: str | None,
    admit: Callable[[Path, int], None] | None = None,
) -> Path:
    """Writes the adapter (and, for `weights`, the optimiser state) under the learner's
    run directory, through a staging folder; returns the directory. Without a name: a
    snapshot in the ephemeral folder, which the caller removes when done with it.
    `admit(target, size)` may refuse the staged checkpoint by raising (`quota`): the
    staging folder is removed and nothing else changes."""
    staging = learner.run_dir / STAGING / secrets.token_hex(8)
    if name is None:
        target = learner.run_dir / EPHEMERAL / secrets.token_hex(8)
    else:
        target = learner.run_dir / kind / check_name(name)
    try:
        learner.model.save_pretrained(staging)
        if kind == "weights":
            torch.save(learner.optimizer.state_dict(), staging / "optimizer.pt")
        if admit is not None:
            admit(target, folder_bytes(staging))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def folder_bytes(folder: Path) -> int:
    """The bytes of the files in a checkpoint's folder."""
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


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
    run_dir: Path,
    model_id: str,
    base_model: str,
    rank: int,
    attn: bool,
    mlp: bool,
    owner: str = LOCAL,
) -> None:
    """Records a training client (once: a record already there is kept)."""
    target = run_dir / model_slug(model_id) / RUN_RECORD
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    record = {"model_id": model_id, "base_model": base_model, "lora_rank": rank, "owner": owner}
    record |= {"train_attn": attn, "train_mlp": mlp, "train_unembed": False}
    partial = target.with_suffix(".partial")
    partial.write_text(json.dumps(record))
    partial.replace(target)


def run_owner(run_dir: Path, model_id: str) -> str | None:
    """The owner recorded for a run (None: no run with that id)."""
    try:
        return str(_record(run_dir, model_id)[1].get("owner", LOCAL))
    except NotFound:
        return None


def _record(run_dir: Path, model_id: str, owner: str | None = None) -> tuple[Path, dict]:
    """A training run's directory and record (of `owner`'s runs, when given).

    Raises:
        NotFound: no training run with that id in the run directory for `owner`.
    """
    missing = NotFound(f"no training run {model_id!r}")
    if not isinstance(model_id, str) or not MODEL_ID.fullmatch(model_id):
        raise missing
    found = run_dir / model_slug(model_id)
    try:
        record = json.loads((found / RUN_RECORD).read_text())
    except (OSError, ValueError) as error:
        raise missing from error
    if not isinstance(record, dict) or record.get("model_id") != model_id:
        raise missing
    if owner is not None and record.get("owner", LOCAL) != owner:
        raise missing
    return found, record


def _stamp(path: Path) -> str:
    return datetime.fromtimestamp(path.stat().st_mtime, tz=UTC).isoformat()


def checkpoint_list(run_dir: Path, model_id: str, owner: str | None = None) -> list[dict]:
    """The run's checkpoints as the REST API describes them, oldest first."""
    found, _ = _record(run_dir, model_id, owner)
    listed = []
    for kind, checkpoint_type in CHECKPOINT_TYPES.items():
        for folder in (found / kind).glob("*/adapter_config.json"):
            folder = folder.parent
            if not NAME.fullmatch(folder.name):
                continue
            listed.append(
                {
                    "checkpoint_id": f"{kind}/{folder.name}",
                    "checkpoint_type": checkpoint_type,
                    "time": _stamp(folder),
                    "tinker_path": tinker_path(model_id, kind, folder.name),
                    "size_bytes": folder_bytes(folder),
                }
            )
    return sorted(listed, key=lambda c: c["time"])


def training_run(run_dir: Path, model_id: str, owner: str | None = None) -> dict:
    """The run as the REST API's TrainingRun describes it."""
    found, record = _record(run_dir, model_id, owner)
    listed = checkpoint_list(run_dir, model_id)

    def last(checkpoint_type: str) -> dict | None:
        return next((c for c in reversed(listed) if c["checkpoint_type"] == checkpoint_type), None)

    stamps = [_stamp(found), *(c["time"] for c in listed)]
    return {
        "training_run_id": record["model_id"],
        "base_model": record["base_model"],
        "model_owner": record.get("owner", LOCAL),
        "is_lora": True,
        "lora_rank": record["lora_rank"],
        "last_request_time": max(stamps),
        "last_checkpoint": last("training"),
        "last_sampler_checkpoint": last("sampler"),
    }


def training_runs(run_dir: Path, owner: str | None = None) -> list[dict]:
    """Every recorded run of `owner` in the run directory, most recently active first; a
    folder that holds no valid record (written by hand, or by an older server) is skipped."""
    runs = []
    for folder in run_dir.glob(f"*/{RUN_RECORD}"):
        model_id = folder.parent.name.replace("_", ":")
        try:
            runs.append(training_run(run_dir, model_id, owner))
        except NotFound:
            continue
    return sorted(runs, key=lambda r: r["last_request_time"], reverse=True)


def weights_info(run_dir: Path, path: str, owner: str | None = None) -> dict:
    """What a checkpoint holds: its base model and LoRA shape (the REST API's
    WeightsInfoResponse).

    Raises:
        NotFound: a malformed path or no such checkpoint of `owner`'s.
    """
    try:
        directory(run_dir, path, owner)
    except UserError as error:
        raise NotFound(str(error)) from error
    _, record = _record(run_dir, path.removeprefix("tinker://").split("/")[0])
    keys = ("base_model", "lora_rank", "train_attn", "train_mlp", "train_unembed")
    return {"is_lora": True} | {key: record[key] for key in keys}


def delete(run_dir: Path, model_id: str, checkpoint_id: str, owner: str | None = None) -> Path:
    """Removes a checkpoint (`weights/NAME` or `sampler_weights/NAME`); returns its directory.

    Raises:
        NotFound: no such checkpoint of `owner`'s.
    """
    kind, _, name = checkpoint_id.partition("/")
    try:
        found = directory(run_dir, tinker_path(model_id, kind, name), owner)
    except UserError as error:
        raise NotFound(str(error)) from error
    shutil.rmtree(found)
    return found
