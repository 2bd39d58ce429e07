"""Preallocated LoRA adapter slots for the embedded engine: publishing a new policy version
is a copy of its weights into a spare slot, not a new set of peft modules.

peft builds new LoRA modules on every `load_adapter` (tens of ms of Python on the engine's
thread, hundreds under load). A slot is a peft adapter (`slot0`, `slot1`, ...) created once
per LoRA shape (target modules, rank); every later adapter of that shape is read from disk
on the caller's thread and copied in place (`Tensor.copy_` in inference mode) into a slot no
request uses, and the policy then points at that slot. A slot in use is never written.

`read_adapter` reads an adapter directory; `Slot.fill` copies it into a slot.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SAFETENSORS = "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterFiles:
    """A LoRA adapter read from its directory, ready to be copied into a slot."""

    path: str
    shape: tuple[Any, ...] | None
    """What a slot must match to take it (`lora_shape`); None: never slotted."""
    scaling: float
    weights: dict[str, torch.Tensor]
    """peft's saved state dict: `<module>.lora_A.weight` etc., no adapter name."""


def lora_shape(config: dict[str, Any]) -> tuple[Any, ...] | None:
    """What two adapters must share to use the same peft modules; None for adapters
    with per-module ranks, DoRA, extra trained modules or anything else the in-place
    copy does not handle (those are loaded by peft instead)."""
    if config.get("peft_type") != "LORA":
        return None
    unsupported = (
        config.get("use_dora"),
        config.get("rank_pattern"),
        config.get("alpha_pattern"),
        config.get("modules_to_save"),
        config.get("lora_bias"),
        config.get("layer_replication"),
        config.get("trainable_token_indices"),
        config.get("target_parameters"),
        config.get("bias", "none") != "none",
    )
    if any(unsupported):
        return None
    targets = config.get("target_modules")
    return (
        tuple(sorted(targets)) if isinstance(targets, list) else targets,
        config.get("r"),
        config.get("layers_to_transform"),
        config.get("fan_in_fan_out"),
    )


def read_adapter(path: str) -> AdapterFiles:
    """Reads an adapter directory saved by peft (config and safetensors weights)."""
    from safetensors.torch import load_file

    config = json.loads((Path(path) / "adapter_config.json").read_text())
    weights_file = Path(path) / SAFETENSORS
    shape = lora_shape(config) if weights_file.exists() else None
    weights = load_file(str(weights_file)) if shape is not None else {}
    rank, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return AdapterFiles(path, shape, scaling, weights)


@dataclass(frozen=True)
class Slot:
    """One preallocated peft adapter and where its weights live."""

    name: str
    shape: tuple[Any, ...] | None
    params: dict[str, torch.Tensor]
    """Saved-state-dict key to the slot's parameter."""
    layers: tuple[Any, ...]
    """peft's LoRA layers, whose `scaling[name]` is the slot's alpha / r."""

    @classmethod
    def of(cls, peft: Any, name: str, shape: tuple[Any, ...] | None) -> Slot:
        """The slot of peft adapter `name` (already created)."""
        marker = f".{name}."
        params = {
            key.replace(marker, "."): value
            for key, value in peft.named_parameters()
            if marker in key and ".lora_" in key
        }
        layers = tuple(m for m in peft.modules() if isinstance(getattr(m, "scaling", None), dict))
        return cls(name, shape, params, tuple(m for m in layers if name in m.scaling))

    def fits(self, adapter: AdapterFiles) -> bool:
        """Whether the adapter's weights are exactly this slot's parameters."""
        return (
            adapter.shape is not None
            and adapter.shape == self.shape
            and adapter.weights.keys() == self.params.keys()
            and all(adapter.weights[k].shape == p.shape for k, p in self.params.items())
        )

    def fill(self, adapter: AdapterFiles) -> None:
        """Copies the adapter in; the caller guarantees no request runs on this slot."""
        # inference_mode, not no_grad: slots made on the scheduler thread (which runs in
        # inference mode) hold inference tensors, which only take in-place updates there.
        with torch.inference_mode():
            # One call for all tensors: each torch call releases the GIL, and on a busy
            # engine every re-acquisition waits for the scheduler thread's turn.
            torch._foreach_copy_(
                list(self.params.values()), [adapter.weights[k] for k in self.params]
            )
        for layer in self.layers:
            layer.scaling[self.name] = adapter.scaling
