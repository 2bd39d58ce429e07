"""Preallocated LoRA adapter slots for the embedded engine: publishing a new policy version
is a copy of its weights into a spare slot, not a new set of peft modules.

peft builds new LoRA modules on every `load_adapter` (tens of ms of Python on the engine's
thread, hundreds under load). A slot is a peft adapter (`slot0`, `slot1`, ...) created once
per LoRA shape (target modules, rank); every later adapter of that shape is read from disk
on the caller's thread and copied in place (`Tensor.copy_` in inference mode) into a slot no
request uses, and the policy then points at that slot. A slot in use is never written.

`read_adapter` reads an adapter directory; `Slot.fill` copies it into a slot; `AdapterTable`
holds an engine's slots, which slot and version the policy is, and how many requests use
each slot.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agents.engines.merged_lora import MergedLora

logger = logging.getLogger(__name__)

SAFETENSORS = "adapter_model.safetensors"
_NO_ADAPTER = "__base__"  # peft's row name for "adapter switched off"
SPARE_SLOTS = 2
"""Slots kept beside the policy's: one for the next version while requests still run on
the previous one."""


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


class AdapterTable:
    """The LoRA slots of one model and the policy's place among them (the embedded engine's
    `agents.engines.batching.Scheduler` holds one).

    A request binds the slot and version current when it is submitted and keeps them to its
    end (`users` counts them); a slot with users is never written. Publishing copies the new
    adapter into a free slot of its shape on the caller's thread; only an adapter of a new
    shape is loaded by peft, on the scheduler thread (`call`).

    Args:
        model: the transformers model; peft wraps it at the first adapter.
        lock: the scheduler's condition, held while requests bind and release slots.
        call: runs a job on the scheduler thread and returns its result.
        merge: whether a batch whose rows all run on one slot runs on that slot's merged
            weights (`agents.engines.merged_lora`) instead of peft's LoRA path.
    """

    def __init__(
        self,
        model: Any,
        lock: threading.Condition,
        call: Callable[[Callable[[], Any]], Any],
        merge: bool = True,
    ):
        self.model = model
        self.merged = MergedLora(merge)
        """Scheduler thread only."""
        self.fills: collections.Counter[str] = collections.Counter()
        """How many times each slot was filled (a refilled slot's merged weights are stale)."""
        self.peft: Any = None
        self._lora_on: bool | None = None
        """Whether peft's LoRA layers are switched on; None: unknown (after peft changed
        its modules)."""
        self.policy: tuple[str | None, int] = (None, 0)
        """(slot, version) new policy requests bind; written under `lock`."""
        self.slots: dict[str, Slot] = {}
        self.users: collections.Counter[str] = collections.Counter()
        """Requests (and scores) bound to each slot; a slot with users is never written."""
        self._publishing = threading.Lock()
        self._cond = lock
        self._call = call

    def bind(self) -> tuple[str | None, int]:
        """The policy's slot and version, counted as used until `unbind` (under the lock)."""
        slot, version = self.policy
        if slot is not None:
            self.users[slot] += 1
        return slot, version

    def unbind(self, slot: str | None) -> None:
        """A user of `slot` is done with it (under the lock)."""
        if slot is not None:
            self.users[slot] -= 1

    def tidy(self) -> None:
        """Between two steps: drops unused slots once adapters of two shapes are held."""
        if len({s.shape for s in self.slots.values()}) > 1:
            self._drop_slots()

    def lora_model(self, adapters: list[str | None]) -> tuple[Any, dict[str, Any]]:
        """The model to call for rows on these adapters (None: the base model), and the
        extra arguments it takes (scheduler thread only).

        Rows that all run on the base model skip peft: its LoRA layers are switched off
        until a row needs one (toggled only when that changes, a walk over the modules).
        Otherwise every base request before the first policy version, or with slots
        prepared early, would pay for peft's per-row path: +2 ms of CPU a one-token
        request on `tiny`, measured. Rows that all run on one slot skip peft too once the
        slot's weights are merged (`agents.engines.merged_lora`).
        """
        if self.peft is None:
            return self.model, {}
        names = [a or _NO_ADAPTER for a in adapters]
        uniform = self.slots.get(names[0]) if len(set(names)) == 1 else None
        if uniform is not None and self.merged.use(
            (uniform.name, self.fills[uniform.name]), uniform.layers
        ):
            self._lora_layers(False)  # the slot's merged weights are in the base layers
            return self.model, {}
        if uniform is None:
            self.merged.miss()
        if all(a is None for a in adapters):
            self._lora_layers(False)
            return self.model, {}
        self._lora_layers(True)
        if uniform is not None:
            self._activate(uniform.name)  # a uniform batch takes peft's plain path
        if set(names) != {self.peft.active_adapter}:
            return self.peft, {"adapter_names": names}  # mixed batch: a LoRA per row
        return self.peft, {}

    def _lora_layers(self, on: bool) -> None:
        if self._lora_on is not on:
            if on:
                self.peft.base_model.enable_adapter_layers()
            else:
                self.peft.base_model.disable_adapter_layers()
            self._lora_on = on

    def load_adapter(self, path: str, version: int) -> None:
        """Serves the LoRA adapter at `path` as policy version `version` (any thread).

        The common case (a slot of its shape is free) copies it into that slot on this
        thread and flips the policy: no wait for the scheduler thread. Otherwise peft loads
        it into a new slot between two steps.
        """
        with self._publishing:
            self._check_version(version)
            adapter = read_adapter(path)
            with self._cond:
                spare = self._spare(adapter)
            if spare is None:
                self._call(lambda: self._load_slot(adapter, version))
                return
            spare.fill(adapter)  # no request is bound to it: none can see a half copy
            with self._cond:
                self.fills[spare.name] += 1
                self._check_version(version)
                self.policy = (spare.name, version)
            logger.debug("adapter %s copied into %s as version %d", path, spare.name, version)

    def prepare_adapter(self, path: str) -> None:
        """Makes the slots of the adapter's shape now, while the engine may be idle, so the
        first version of that shape is copied in like every later one (any thread)."""
        adapter = read_adapter(path)
        if adapter.shape is None:
            logger.warning("adapter %s cannot be slotted; each version loads through peft", path)
            return
        with self._publishing:
            with self._cond:
                if self._spare(adapter) is not None:
                    return
            self._call(lambda: self._make_slots(adapter))

    def _make_slots(self, adapter: AdapterFiles) -> None:
        """A job: peft loads the adapter into a slot that is not the policy's, then spares."""
        name = self._peft_load(adapter)
        self._add_spares(adapter, name)

    def _peft_load(self, adapter: AdapterFiles) -> str:
        """peft loads the adapter into a new slot; returns the slot's name."""
        from peft import PeftModel

        name = self._new_slot_name()
        self.merged.restore()  # peft's new modules wrap the base layers as they are
        if self.peft is None:
            self.peft = PeftModel.from_pretrained(self.model, adapter.path, adapter_name=name)
        else:
            self.peft.load_adapter(adapter.path, adapter_name=name)
        self.peft.eval()
        self._lora_on = None  # new LoRA modules come switched on
        with self._cond:
            self.slots[name] = Slot.of(self.peft, name, adapter.shape)
        return name

    def _check_version(self, version: int) -> None:
        if version <= self.policy[1]:
            raise ValueError(f"adapter versions must increase: serving {self.policy[1]}")

    def _spare(self, adapter: AdapterFiles) -> Slot | None:
        """A slot that fits the adapter and no request uses (under `_cond`)."""
        for slot in self.slots.values():
            if slot.name != self.policy[0] and not self.users[slot.name] and slot.fits(adapter):
                return slot
        return None

    def _load_slot(self, adapter: AdapterFiles, version: int) -> None:
        """A job: peft loads the adapter into a new slot, which becomes the policy's."""
        name = self._peft_load(adapter)
        with self._cond:
            self._check_version(version)
        # Spares now, in this publish: made in the background they were still being made
        # (a second or more on a loaded machine) when the next version came, which then
        # waited for them.
        self._add_spares(adapter, name)
        with self._cond:
            self.policy = (name, version)
        self._drop_slots()

    def _add_spares(self, adapter: AdapterFiles, like: str) -> None:
        """Empty slots beside slot `like`, for the next versions of its shape."""
        if adapter.shape is None or self.peft is None:
            return
        config = self.peft.peft_config[like]
        self.merged.restore()
        while sum(s.shape == adapter.shape for s in self.slots.values()) <= SPARE_SLOTS:
            name = self._new_slot_name()
            self.peft.add_adapter(name, config)
            self._lora_on = None
            slot = Slot.of(self.peft, name, adapter.shape)
            with self._cond:
                self.slots[name] = slot
        self.peft.eval()

    def _new_slot_name(self) -> str:
        return f"slot{max((int(n[4:]) for n in self.slots), default=-1) + 1}"

    def _activate(self, name: str) -> None:
        if self.peft.active_adapter != name:
            self.peft.set_adapter(name, inference_mode=True)

    def _drop_slots(self) -> None:
        """Deletes slots of another shape than the policy's (or of none: adapters peft
        loads every time) that no request uses."""
        with self._cond:
            policy = self.policy[0]
            shape = self.slots[policy].shape if policy else None
            unused = [
                n
                for n, slot in self.slots.items()
                if (slot.shape != shape or slot.shape is None) and n != policy and not self.users[n]
            ]
            for name in unused:
                del self.slots[name]
        for name in unused:
            self.merged.forget(name)
            self.fills[name] += 1  # a later slot of the same name is another adapter
            self._activate(policy or name)
            self.peft.delete_adapter(name)
            logger.info("dropped adapter slot %s: no request uses its shape", name)


def drop_row_hooks(peft: Any) -> None:
    """Removes the hooks that give each row its adapter, left behind by a forward pass that
    raised: peft registers them for one pass but removes them only when it returns (peft
    issue #3475), and each later pass would then fail with the stale rows' adapters."""
    for module in peft.modules():
        hooks = module._forward_pre_hooks
        for key, hook in list(hooks.items()):
            if isinstance(hook, functools.partial) and "adapter_names" in hook.keywords:
                del hooks[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)
