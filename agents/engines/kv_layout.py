"""The embedded engine's shared KV cache: rows left-padded to common columns, grown in place.

Each layer's keys and values are (rows, kv heads, columns, head dim); a row's tokens end at
the last column, and the columns before its first token are padding that the attention mask
hides (`agents.engines.batching` keeps the mask). A row prefilled after a reused prefix has a
second stretch of padding, between the prefix and the rest of its prompt: also masked, so
its logits are those it would get alone (to float rounding).

transformers' `DynamicLayer` concatenates on every `update`: each decode step would copy
the whole cache. `GrowingLayer` keeps its keys and values as views of the first columns of
larger buffers and writes a step's column after them; only a step that finds no spare
column copies, into buffers `GROWTH` columns longer. Rows join or leave by a copy into new
buffers (`concat_rows`, `select_rows`), once per change, as before. It relies only on
`Cache(layers=...)`, `DynamicLayer` and its public `keys`, `values`, `lazy_initialization`
and `get_seq_length` (the same in transformers 5.17 and 5.19).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

GROWTH = 64
"""Spare columns a buffer gets when it is made: a copy every 64 decode steps at most."""


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` that decodes into spare columns of its buffers, in place.

    Args:
        keys, values: buffers (rows, kv heads, capacity, head dim), or None for a layer that
            makes its own at its first `update`.
        length: columns of the buffers already filled.
    """

    def __init__(
        self,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        length: int = 0,
    ):
        super().__init__()
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        if keys is not None and values is not None:
            self._adopt(keys, values, length)

    def _adopt(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        self.lazy_initialization(keys, values)
        self.buffers = (keys, values)
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if self.buffers is None or end > self.buffers[0].shape[-2]:
            old = (self.keys, self.values) if start else (None, None)
            self._adopt(_buffer(old[0], key_states, end), _buffer(old[1], value_states, end), start)
        assert self.buffers is not None
        keys, values = self.buffers
        keys[:, :, start:end] = key_states
        values[:, :, start:end] = value_states
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]
        return self.keys, self.values


def _buffer(old: torch.Tensor | None, new: torch.Tensor, end: int) -> torch.Tensor:
    """A zero buffer for `end` columns and `GROWTH` more, holding `old`'s columns first."""
    buffer = new.new_zeros((*new.shape[:2], end + GROWTH, new.shape[3]))
    if old is not None:
        buffer[:, :, : old.shape[2]] = old
    return buffer


def empty_cache() -> Cache:
    """A cache of `GrowingLayer`s, made as the model's layers first update it."""
    return Cache(layer_class_to_replicate=GrowingLayer)


def with_prefixes(prefixes: Sequence[Sequence[torch.Tensor]], room: int) -> Cache:
    """A cache of one row per entry of `prefixes`, whose KV pieces (layers, 2, kv heads,
    tokens, head dim; `agents.engines.prefix_cache`) are laid end to end and left-padded to
    the longest row, with `room` spare columns after them for the prompts' other tokens."""
    lengths = [sum(piece.shape[-2] for piece in pieces) for pieces in prefixes]
    width = max(lengths)
    if width == 0:
        return empty_cache()
    sample = next(piece for pieces in prefixes for piece in pieces)
    layers, _, heads, _, dim = sample.shape
    past = sample.new_zeros((layers, 2, len(prefixes), heads, width + room + GROWTH, dim))
    for row, (pieces, length) in enumerate(zip(prefixes, lengths, strict=True)):
        at = width - length
        for piece in pieces:
            past[:, :, row, :, at : at + piece.shape[-2]] = piece
            at += piece.shape[-2]
    return Cache(layers=[GrowingLayer(past[i, 0], past[i, 1], width) for i in range(layers)])


def concat_rows(first: Cache, second: Cache) -> Cache:
    """Both caches' rows in one, each left-padded to the longer one's columns."""
    width = max(first.get_seq_length(), second.get_seq_length())
    layers = []
    for one, two in zip(first.layers, second.layers, strict=True):
        keys = _stacked([one.keys, two.keys], width)
        values = _stacked([one.values, two.values], width)
        layers.append(GrowingLayer(keys, values, width))
    return Cache(layers=layers)


def select_rows(cache: Cache, keep: Sequence[int], start: int) -> Cache:
    """Rows `keep` (ascending) of the cache, from column `start` on."""
    runs = _runs(keep)
    width = cache.get_seq_length() - start
    layers = []
    for layer in cache.layers:
        keys = _stacked([layer.keys[a:b, :, start:] for a, b in runs], width)
        values = _stacked([layer.values[a:b, :, start:] for a, b in runs], width)
        layers.append(GrowingLayer(keys, values, width))
    return Cache(layers=layers)


def row_kv(cache: Cache, row: int, columns: torch.Tensor) -> torch.Tensor:
    """A copy of one row's KV at `columns`: (layers, 2, kv heads, columns, head dim)."""
    return torch.stack(
        [
            torch.stack(
                (
                    layer.keys[row].index_select(1, columns),
                    layer.values[row].index_select(1, columns),
                )
            )
            for layer in cache.layers
        ]
    )


def _stacked(blocks: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Row blocks (rows, kv heads, columns, head dim), one under the other, each ending at
    column `width` of a zero buffer with `GROWTH` spare columns after it: one copy each."""
    rows = sum(block.shape[0] for block in blocks)
    heads, dim = blocks[0].shape[1], blocks[0].shape[3]
    out = blocks[0].new_zeros((rows, heads, width + GROWTH, dim))
    at = 0
    for block in blocks:
        out[at : at + block.shape[0], :, width - block.shape[2] : width] = block
        at += block.shape[0]
    return out


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Ascending row numbers as stretches [a, b) of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs
