"""The shared KV cache's layout: decode steps write into spare columns in place, rows that
join are written into spare rows and rows that leave are filled by the last ones, each row
keeping its states right-aligned."""

from __future__ import annotations

import torch

from agents.engines.kv_layout import (
    GROWTH,
    GrowingLayer,
    add_rows,
    drop_rows,
    empty_cache,
    row_kv,
    trim_columns,
    with_prefixes,
)


def states(rows, columns, start=0.0):
    """(rows, 1 head, columns, 2) states numbered from `start`, all different."""
    count = rows * columns * 2
    return torch.arange(start, start + count).reshape(rows, 1, columns, 2)


def filled(rows, columns, start=0.0):
    cache = empty_cache()
    block = states(rows, columns, start)
    cache.update(block, block + 0.5, 0)
    return cache, block


def test_decode_steps_write_in_place_until_the_spare_columns_run_out():
    layer = GrowingLayer()
    prompt = states(3, 5)
    keys, _ = layer.update(prompt, prompt)
    assert torch.equal(keys, prompt)
    buffer = layer.keys.data_ptr()
    written = [prompt]
    for step in range(GROWTH + 1):
        column = states(3, 1, start=1000.0 * (step + 1))
        keys, values = layer.update(column, column)
        written.append(column)
        assert torch.equal(keys, torch.cat(written, dim=2))
        assert torch.equal(values, keys)
        # in place for the first GROWTH steps; the step after them copies into a new buffer
        assert (layer.keys.data_ptr() == buffer) == (step < GROWTH)


def test_joining_rows_are_left_padded_to_the_wider_and_leaving_rows_filled_by_the_last():
    batch, one = filled(2, 4)
    fresh, two = filled(1, 6, start=100.0)
    grown = add_rows(batch, fresh, max_rows=8)
    keys, values = batch.layers[0].keys, batch.layers[0].values
    assert grown == 2 and keys.shape == (3, 1, 6, 2)
    assert torch.equal(keys[:2, :, 2:], one) and not keys[:2, :, :2].any()
    assert torch.equal(keys[2:], two) and torch.equal(values[2:], two + 0.5)
    assert torch.equal(row_kv(batch, 2, torch.tensor([4, 5]))[0, 0], two[0, :, 4:])
    # row 0 leaves: row 2 (the last) takes its place, row 1 stays where it is
    assert drop_rows(batch, [True, False, False]) == [2, 1]
    keys = batch.layers[0].keys
    assert torch.equal(keys[0], two[0]) and torch.equal(keys[1, :, 2:], one[1])
    trim_columns(batch, 2)
    assert torch.equal(batch.layers[0].keys, torch.stack([two[0, :, 2:], one[1]]))
    assert batch.get_seq_length() == 4


def test_rows_join_in_place_while_room_lasts():
    batch, one = filled(1, 4)
    add_rows(batch, filled(1, 3, start=50.0)[0], max_rows=4)  # makes room for 4 rows
    buffer = batch.layers[0].buffers[0].data_ptr()
    before = batch.layers[0].keys.clone()
    fresh, two = filled(2, 4, start=100.0)
    assert add_rows(batch, fresh, max_rows=4) == 0
    assert batch.layers[0].buffers[0].data_ptr() == buffer  # no copy of the batch
    assert torch.equal(batch.layers[0].keys[:2], before)
    assert torch.equal(batch.layers[0].keys[2:], two)
    # a fifth row is past the room: the buffers are made again, every row kept
    add_rows(batch, filled(1, 2, start=200.0)[0], max_rows=4)
    assert batch.layers[0].keys.shape[0] == 5
    assert torch.equal(batch.layers[0].keys[2:4], two)


def test_stale_states_of_earlier_rows_never_show_as_padding():
    batch, _ = filled(2, 6)
    drop_rows(batch, [False, True])  # row 1's states stay in its spare row
    add_rows(batch, filled(1, 2, start=100.0)[0], max_rows=4)
    keys = batch.layers[0].keys
    assert not keys[1, :, :4].any() and torch.equal(keys[1, :, 4:], states(1, 2, 100.0)[0])


def test_reused_prefixes_are_laid_end_to_end_and_left_padded():
    pieces = [torch.ones(1, 2, 1, 3, 2), 2 * torch.ones(1, 2, 1, 2, 2)]
    cache = with_prefixes([pieces, [], pieces[1:]], room=4)
    keys = cache.layers[0].keys
    assert keys.shape == (3, 1, 5, 2)
    assert keys[0, 0, :, 0].tolist() == [1, 1, 1, 2, 2]
    assert keys[1].abs().sum() == 0
    assert keys[2, 0, :, 0].tolist() == [0, 0, 0, 2, 2]
    assert with_prefixes([[], []], room=4).get_seq_length() == 0
