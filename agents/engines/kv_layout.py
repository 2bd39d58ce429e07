"""The embedded engine's shared KV cache: rows left-padded to common columns, changed in place.

Each layer's keys and values are (rows, kv heads, columns, head dim) views of larger buffers;
a row's tokens end at the view's last column, and the columns before its first token are
padding that the attention mask hides (`agents.engines.batching` keeps the mask). A row
prefilled after a reused prefix has a second stretch of padding, between the prefix and the
rest of its prompt: also masked, so its logits are those it would get alone (to float
rounding).

The buffers have spare rows, spare columns after the view (a decode step writes its column
there) and a margin before it (where a joining row wider than the batch starts), so nothing
that happens every few steps copies the batch:
- a decode step writes one column (transformers' `DynamicLayer` would concatenate, copying
  the whole cache every step);
- rows that join are written into spare rows (`add_rows`), only their own KV copied;
- rows that leave hand their places to the last rows (`drop_rows`), only those rows' KV
  moving; all-padding columns on the left are dropped by moving the view's start
  (`trim_columns`).
Before this, every join and every leave copied every row's KV: in a multi-turn evaluation
(64 episodes in flight, each turn a join and a leave) that was a third of the engine's time,
measured with py-spy. The buffers are copied only when rows, columns or the margin run out.

It relies only on `Cache(layers=...)`, `DynamicLayer` and its public `keys`, `values`,
`lazy_initialization` and `get_seq_length` (the same in transformers 5.17 and 5.19).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

GROWTH = 64
"""Spare columns after the view a buffer gets when it is made: a copy every 64 decode steps
at most."""

MARGIN = 64
"""Spare columns before the view a buffer gets when it is made, for joining rows wider than
the batch."""


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views `[:rows, :, start:end]` of buffers with
    spare rows and columns, changed in place.

    Args:
        keys, values: buffers (rows, kv heads, capacity, head dim), or None for a layer that
            makes its own at its first `update`.
        length: columns of the buffers already filled, from column 0.
    """

    def __init__(
        self,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        length: int = 0,
    ):
        super().__init__()
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self.rows = self.start = self.end = 0
        if keys is not None and values is not None:
            self._adopt(keys, values, keys.shape[0], 0, length)

    def _adopt(
        self, keys: torch.Tensor, values: torch.Tensor, rows: int, start: int, end: int
    ) -> None:
        self.lazy_initialization(keys, values)
        self.buffers = (keys, values)
        self.rows, self.start, self.end = rows, start, end
        self._view()

    def _view(self) -> None:
        assert self.buffers is not None
        keys, values = self.buffers
        self.keys = keys[: self.rows, :, self.start : self.end]
        self.values = values[: self.rows, :, self.start : self.end]

    @property
    def row_capacity(self) -> int:
        return 0 if self.buffers is None else self.buffers[0].shape[0]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.buffers is None:
            rows, heads, _, dim = key_states.shape
            empty = key_states.new_zeros((rows, heads, 0, dim))
            self._adopt(empty, empty.clone(), rows, 0, 0)
        width = key_states.shape[-2]
        assert self.buffers is not None
        if self.end + width > self.buffers[0].shape[-2]:
            self.relayout(self.row_capacity, self.end - self.start, room=width)
        keys, values = self.buffers
        keys[: self.rows, :, self.end : self.end + width] = key_states
        values[: self.rows, :, self.end : self.end + width] = value_states
        self.end += width
        self._view()
        return self.keys, self.values

    def relayout(self, row_capacity: int, width: int, room: int = 0) -> None:
        """Copies the view into new buffers of `row_capacity` rows where it ends at column
        `MARGIN + width`, with `room + GROWTH` columns after it."""
        assert self.buffers is not None
        live = self.end - self.start
        heads, dim = self.keys.shape[1], self.keys.shape[3]
        made = []
        for old in (self.keys, self.values):
            buffer = old.new_zeros((row_capacity, heads, MARGIN + width + room + GROWTH, dim))
            buffer[: self.rows, :, MARGIN + width - live : MARGIN + width] = old
            made.append(buffer)
        self._adopt(made[0], made[1], self.rows, MARGIN + width - live, MARGIN + width)


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


def drop_rows(cache: Cache, gone: Sequence[bool]) -> list[int]:
    """Drops the rows flagged `gone`, in place: the last kept rows move into the places of
    gone ones. Returns the kept rows' old numbers in their new order."""
    count = len(gone)
    kept = count - sum(gone)
    holes = [row for row in range(kept) if gone[row]]
    movers = [row for row in range(kept, count) if not gone[row]]
    order = list(range(kept))
    for hole, mover in zip(holes, movers, strict=True):
        order[hole] = mover
    for layer in _layers(cache):
        if holes:
            assert layer.buffers is not None
            to, taken = torch.tensor(holes), torch.tensor(movers)
            for buffer in layer.buffers:
                live = buffer[:, :, layer.start : layer.end]
                live[to] = live[taken]
        layer.rows = kept
        layer._view()
    return order


def trim_columns(cache: Cache, count: int) -> None:
    """Drops the first `count` columns of every row (padding in all of them), in place."""
    for layer in _layers(cache):
        layer.start += count
        layer._view()


def add_rows(cache: Cache, fresh: Cache, max_rows: int) -> int:
    """Appends `fresh`'s rows to the cache's, each left-padded to the wider of the two;
    returns the columns the cache grew by on the left. Written into spare rows and margin
    where they suffice; otherwise the buffers are made again, with up to `max_rows` rows
    (all layers first, so that running out of memory leaves every layer as it was)."""
    pairs = list(zip(_layers(cache), _layers(fresh), strict=True))
    for layer, joining in pairs:
        rows = layer.rows + joining.rows
        width = joining.end - joining.start
        if rows > layer.row_capacity or width > layer.end:
            capacity = max(rows, min(2 * rows, max_rows))
            layer.relayout(capacity, max(layer.end - layer.start, width))
    grown = 0
    for layer, joining in pairs:
        assert layer.buffers is not None
        rows, width = layer.rows + joining.rows, joining.end - joining.start
        start = min(layer.start, layer.end - width)
        grown = layer.start - start
        for buffer, states in zip(layer.buffers, (joining.keys, joining.values), strict=True):
            buffer[: layer.rows, :, start : layer.start] = 0  # the old rows' new padding
            buffer[layer.rows : rows, :, start : layer.end - width] = 0
            buffer[layer.rows : rows, :, layer.end - width : layer.end] = states
        layer.rows, layer.start = rows, start
        layer._view()
    return grown


def compact_rows(cache: Cache, mask: torch.Tensor) -> torch.Tensor:
    """Moves each row's real columns (`mask`'s ones) to the right end of the view, in order,
    in place; returns the mask that says so (each row's ones at its end)."""
    width = mask.shape[1]
    kept = mask.sum(-1).tolist()
    moves = [
        (row, mask[row].nonzero()[:, 0], count)
        for row, count in enumerate(kept)
        if count and not bool(mask[row, width - count :].all())
    ]
    for layer in _layers(cache):
        for row, columns, count in moves:
            for states in (layer.keys, layer.values):
                states[row, :, width - count :] = states[row].index_select(1, columns)
    return (torch.arange(width)[None, :] >= width - torch.tensor(kept)[:, None]).to(mask.dtype)


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


def _layers(cache: Cache) -> list[GrowingLayer]:
    layers = cache.layers
    assert all(isinstance(layer, GrowingLayer) for layer in layers)
    return layers
