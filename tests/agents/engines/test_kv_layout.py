"""The shared KV cache's layout: decode steps write into spare columns in place, and rows
joining or leaving keep their states, right-aligned."""

from __future__ import annotations

import torch

from agents.engines.kv_layout import (
    GROWTH,
    GrowingLayer,
    concat_rows,
    empty_cache,
    row_kv,
    select_rows,
    with_prefixes,
)


def states(rows, columns, start=0.0):
    """(rows, 1 head, columns, 2) states numbered from `start`, all different."""
    count = rows * columns * 2
    return torch.arange(start, start + count).reshape(rows, 1, columns, 2)


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


def test_rows_joining_and_leaving_keep_their_states_right_aligned():
    first, second = empty_cache(), empty_cache()
    one, two = states(2, 4), states(1, 6, start=100.0)
    first.update(one, one, 0)
    second.update(two, two, 0)
    both = concat_rows(first, second)
    keys = both.layers[0].keys
    assert keys.shape == (3, 1, 6, 2)
    assert torch.equal(keys[:2, :, 2:], one) and not keys[:2, :, :2].any()
    assert torch.equal(keys[2:], two)
    kept = select_rows(both, [0, 2], start=1).layers[0].keys
    assert torch.equal(kept, keys[[0, 2], :, 1:])
    assert torch.equal(row_kv(both, 2, torch.tensor([4, 5]))[0, 0], two[0, :, 4:])


def test_reused_prefixes_are_laid_end_to_end_and_left_padded():
    pieces = [torch.ones(1, 2, 1, 3, 2), 2 * torch.ones(1, 2, 1, 2, 2)]
    cache = with_prefixes([pieces, [], pieces[1:]], room=4)
    keys = cache.layers[0].keys
    assert keys.shape == (3, 1, 5, 2)
    assert keys[0, 0, :, 0].tolist() == [1, 1, 1, 2, 2]
    assert keys[1].abs().sum() == 0
    assert keys[2, 0, :, 0].tolist() == [0, 0, 0, 2, 2]
    assert with_prefixes([[], []], room=4).get_seq_length() == 0
