"""The local learner's checkpoints and adapters on disk: a checkpoint folder committed
atomically (`commit_checkpoint`, which the Tinker learner uses too; `newest_checkpoint`
finds it after any crash), the peft learner's state in it (`save_lora_checkpoint`,
`load_lora_checkpoint`), and a trained adapter to start from (`resolve_adapter`,
`load_adapter`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

START_WEIGHTS = "start.safetensors"
"""A checkpoint's copy of `Learner.start_weights` (absent before RL's first step)."""


def resolve_adapter(path: str | Path) -> Path:
    """An adapter directory from `path`: the directory itself (it holds
    adapter_config.json), or a run directory, whose newest adapters/v<N> is taken.

    Raises:
        ValueError: neither, saying what was found.
    """
    root = Path(path)
    if (root / "adapter_config.json").exists():
        return root
    versions = sorted(
        (d for d in (root / "adapters").glob("v*") if d.name[1:].isdigit()),
        key=lambda d: int(d.name[1:]),
    )
    if versions:
        return versions[-1]
    raise ValueError(
        f"{path} is neither a LoRA adapter (no adapter_config.json) nor a run directory "
        "with adapters/v<N>"
    )


def commit_checkpoint(run_dir: Path, write: Callable[[Path], dict[str, Any]]) -> Path:
    """A checkpoint of a learner in `run_dir/checkpoints/latest`, atomically: `write` fills
    a staging folder and returns the state saved beside it as state.json; the folder is
    fsync'd, then takes the place of the previous one, so a crash at any point leaves one
    complete checkpoint (`newest_checkpoint` finds it)."""
    root = run_dir / "checkpoints"
    staging, latest, previous = root / "staging", root / "latest", root / "previous"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    state = write(staging)
    (staging / "state.json").write_text(json.dumps(state))
    _fsync_tree(staging)
    shutil.rmtree(previous, ignore_errors=True)
    if latest.exists():
        latest.rename(previous)
    staging.rename(latest)
    shutil.rmtree(previous, ignore_errors=True)
    return latest


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The folder of the newest complete checkpoint in `run_dir` (None: there is none)."""
    root = run_dir / "checkpoints"
    complete = (d for d in (root / "latest", root / "previous") if (d / "state.json").exists())
    return next(complete, None)


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def save_lora_checkpoint(
    run_dir: Path,
    model: Any,
    optimizer: torch.optim.Optimizer,
    start_weights: dict[str, torch.Tensor] | None,
    state: dict[str, Any],
) -> Path:
    """The peft learner's checkpoint: adapter, optimiser, RNG states, RL's starting weights
    and `state` (step, version, ledger, the caller's cursor), atomically."""
    from safetensors.torch import save_file

    def write(staging: Path) -> dict[str, Any]:
        model.save_pretrained(staging / "adapter")
        if start_weights is not None:
            start = {name: w.cpu() for name, w in start_weights.items()}
            save_file(start, staging / START_WEIGHTS)
        torch.save(optimizer.state_dict(), staging / "optimizer.pt")
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        torch.save(rng, staging / "rng.pt")
        return state

    return commit_checkpoint(run_dir, write)


def load_lora_checkpoint(
    found: Path, model: Any, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Restores the adapter, optimiser and RNG states of the checkpoint in `found` (from
    `newest_checkpoint`); returns its state.json."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(model, load_file(found / "adapter" / "adapter_model.safetensors"))
    optimizer.load_state_dict(torch.load(found / "optimizer.pt", weights_only=False))
    rng = torch.load(found / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    state: dict[str, Any] = json.loads((found / "state.json").read_text())
    return state


def load_adapter(model: Any, adapter: str | Path) -> Path:
    """Loads a trained LoRA adapter's weights (`resolve_adapter`) into the peft `model`;
    returns where they came from.

    Raises:
        ValueError: no adapter there, or one shaped unlike the model's LoRA.
    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = resolve_adapter(adapter)
    saved = json.loads((path / "adapter_config.json").read_text())
    mine = model.peft_config["default"]
    if saved.get("r") != mine.r or set(saved.get("target_modules") or ()) != set(
        mine.target_modules
    ):
        raise ValueError(
            f"the adapter at {path} has rank {saved.get('r')} on "
            f"{sorted(saved.get('target_modules') or ())}; this learner's is rank {mine.r} "
            f"on {sorted(mine.target_modules)}: set trainer.lora_rank and "
            "trainer.target_modules to match it"
        )
    result = set_peft_model_state_dict(model, load_file(path / "adapter_model.safetensors"))
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"the adapter at {path} has weights this model lacks")
    return path


def save_adapter_dir(model: Any, target: Path) -> Path:
    """Writes the peft `model`'s adapter to `target` through a staging folder, so that a
    reader never sees half an adapter; returns `target`."""
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target
