"""Merged LoRA weights for the embedded engine's uniform batches.

peft's LoRA layers add `scaling * B(A(x))` to every targeted linear layer's output: on
SmolLM2-135M (rank 16 on its seven projections, 210 layers) that is a third more time on a
64-row decode step (199 ms against 151 with the adapter switched off, measured on the
2-core CPU machine), almost all of it the overhead of 420 tiny matrix products and their
additions, not their arithmetic. When every row of a pass runs on one adapter, the same
output comes from one product with `W + scaling * B @ A`: this module builds those merged
weights once per adapter slot and fill, and swaps them in for the base weights (an
attribute assignment per layer, no copy) while the batch stays on that slot; any other
pass (base rows, a mixed batch, another slot) gets the base weights back first.

The base weights are never written: a merged set lives beside them (as much memory as the
targeted layers' weights) and the originals come back by reference, so no rounding
accumulates over many merges (peft's in-place `merge`/`unmerge` would). The merged
product rounds differently from the two small ones: on SmolLM2 with a rank-16 adapter, 64
rows of 48 greedy tokens came out the same with log-probs at most 2e-5 apart, and the
decode rate went from 162 to 213 tokens/s (`benchmarks/perf/decode.py`, 2-core CPU).

Only the scheduler thread calls it (all model access happens there).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

MERGE_AFTER = 4
"""Consecutive uniform passes on one slot before its weights are merged: a scoring call or
a short burst does not pay for a merge (about 0.1 s on SmolLM2-135M)."""

Key = tuple[str, int]
"""(slot name, how many times that slot was filled): a refilled slot is another adapter."""


class MergedLora:
    """The merged weights of at most one adapter slot, and whether they are in the model.

    Args:
        enabled: False: never merge (every pass takes peft's LoRA path).
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.merges = 0
        """Merged sets built so far (for tests and logs)."""
        self._key: Key | None = None
        self._swaps: list[tuple[Any, torch.nn.Parameter, torch.nn.Parameter]] = []
        """(base layer, its own weight, the merged weight) per LoRA layer of the slot."""
        self._applied = False
        self._streak: tuple[Key | None, int] = (None, 0)

    def use(self, key: Key, layers: tuple[Any, ...]) -> bool:
        """A pass whose rows all run on slot `key` (its peft LoRA `layers`): True when the
        model's base layers now hold that slot's merged weights (the caller switches peft's
        LoRA layers off for the pass), False when the pass must take peft's path."""
        if not self.enabled:
            return False
        if self._key != key:
            seen, count = self._streak
            self._streak = (key, count + 1 if seen == key else 1)
            if self._streak[1] < MERGE_AFTER or not self._build(key, layers):
                self.restore()
                return False
        if not self._applied:
            for base, _, merged in self._swaps:
                base.weight = merged
            self._applied = True
        return True

    def miss(self) -> None:
        """A pass that is not uniform on one slot: base weights back, the streak broken."""
        self._streak = (None, 0)
        self.restore()

    def restore(self) -> None:
        """Puts every base layer's own weight back (before any pass that is not merged, and
        before peft changes its modules)."""
        if self._applied:
            for base, own, _ in self._swaps:
                base.weight = own
            self._applied = False

    def forget(self, slot: str) -> None:
        """Drops the merged set of `slot` (deleted, or about to be refilled)."""
        if self._key is not None and self._key[0] == slot:
            self.restore()
            self._key, self._swaps = None, []

    def _build(self, key: Key, layers: tuple[Any, ...]) -> bool:
        """Merges slot `key`'s adapter into new weights beside the base ones; False where a
        layer is not a plain peft LoRA linear layer (then the slot keeps peft's path)."""
        name = key[0]
        if not layers or not all(_mergeable(layer, name) for layer in layers):
            return False
        self.restore()
        self._key, self._swaps = None, []  # the old set's memory goes before the new one's
        swaps = []
        for layer in layers:
            base = layer.base_layer
            own = base.weight
            delta = layer.get_delta_weight(name).to(own.dtype)
            swaps.append((base, own, torch.nn.Parameter(own + delta, requires_grad=False)))
        self._key, self._swaps = key, swaps
        self.merges += 1
        logger.debug("merged adapter slot %s (fill %d) into %d layers", *key, len(swaps))
        return True


def _mergeable(layer: Any, name: str) -> bool:
    """Whether `layer` is a peft LoRA linear layer whose slot `name` merges into its base
    layer's weight (no DoRA, no bias of its own, a plain `nn.Linear` below it)."""
    base = getattr(layer, "base_layer", None)
    return (
        isinstance(base, torch.nn.Linear)
        and hasattr(layer, "get_delta_weight")
        and name in getattr(layer, "lora_A", {})
        and not getattr(layer, "use_dora", {}).get(name, False)
        and not getattr(layer, "lora_bias", {}).get(name, False)
    )
