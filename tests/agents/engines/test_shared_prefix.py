"""Shared-prefix (cascade) attention in the embedded engine: rows that start with the same
prompt prefix read its KV from one block, and each row still gets what it gets alone; the
prefix cache still holds whole sequences; a policy version never reads another's block."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from agents.engines import attention
from agents.engines.attention import SharedPrefix
from agents.engines.base import SamplingParams
from agents.engines.batch import MIN_SHARED, Batch, Request, SharedBlock, kv_from
from agents.engines.embedded import EmbeddedEngine
from agents.engines.kv_layout import compact_rows, empty_cache
from tests.agents.engines.conftest import save_random_adapter
from tests.agents.engines.test_batching import collect, queued_together, submit

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
LONG = SamplingParams(temperature=0.0, max_tokens=64)
SYSTEM = (
    "You are an agent with a calculator. Call it for every sum, read its result, answer with "
    "the number alone. Never guess, never explain, and stop once you have answered."
)


def test_attention_over_a_shared_prefix_equals_attention_over_whole_rows():
    generator = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, dim, prefix, own = 4, 6, 2, 8, 10, 7
    lengths = [10, 6, 0, 10]  # whole prefix, part of it, none, whole
    query = torch.randn(rows, heads, 1, dim, generator=generator)
    keys, values = (torch.randn(rows, kv_heads, own, dim, generator=generator) for _ in "kv")
    shared = torch.randn(1, 2, kv_heads, prefix, dim, generator=generator)
    mask = torch.ones(rows, 1, 1, own, dtype=torch.bool)
    mask[1, ..., :3] = False  # padding in a row's own cache
    layer = SimpleNamespace(layer_idx=0)
    got, _ = attention.grouped_sdpa(
        layer,
        query,
        keys,
        values,
        mask,
        scaling=dim**-0.5,
        shared_prefix=SharedPrefix(shared, torch.tensor(lengths)),
    )
    for row, length in enumerate(lengths):
        whole_keys = torch.cat([shared[0, 0, :, :length], keys[row]], dim=1)
        whole_values = torch.cat([shared[0, 1, :, :length], values[row]], dim=1)
        whole_mask = torch.cat([torch.ones(length, dtype=torch.bool), mask[row, 0, 0]])
        expected = F.scaled_dot_product_attention(
            query[row : row + 1],
            whole_keys[None],
            whole_values[None],
            attn_mask=whole_mask[None, None, None],
            scale=dim**-0.5,
            enable_gqa=True,
        )
        assert torch.allclose(got[row], expected[0].transpose(0, 1), atol=1e-6, rtol=0)


def test_compacted_rows_keep_their_states_in_order_at_the_right_end():
    cache = empty_cache()
    states = torch.arange(3 * 6 * 2, dtype=torch.float32).reshape(3, 1, 6, 2)
    cache.update(states, states + 0.5, 0)
    mask = torch.tensor([[0, 1, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]])
    compacted = compact_rows(cache, mask)
    assert compacted.tolist() == [[0, 0, 0, 1, 1, 1], [1] * 6, [0, 0, 0, 0, 1, 1]]
    layer = cache.layers[0]
    for row in range(3):
        real = states[row, :, mask[row].bool()]
        assert torch.equal(layer.keys[row, :, compacted[row].bool()], real)
        assert torch.equal(layer.values[row, :, compacted[row].bool()], real + 0.5)


def test_a_row_reading_a_block_offers_the_block_then_its_own_kv_to_the_prefix_cache():
    cache = empty_cache()
    own = torch.arange(2 * 1 * 5 * 2, dtype=torch.float32).reshape(2, 1, 5, 2)
    cache.update(own, own + 0.5, 0)
    block_kv = -torch.arange(1 * 2 * 1 * 4 * 2, dtype=torch.float32).reshape(1, 2, 1, 4, 2)
    block = SharedBlock((None, 0), (1, 2, 3, 4), block_kv)
    request = Request([1, 2, 3, 4, 5, 6], GREEDY, 12, None, None, 0, queue.SimpleQueue())
    request.ids = [7, 8]
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    batch = Batch(
        [Request([9], GREEDY, 12, None, None, 0, queue.SimpleQueue()), request],
        cache,
        mask,
        [0, 8],
        [0, 4],
    )
    tokens, kv = kv_from(batch, 1, block)
    assert tokens == [1, 2, 3, 4, 5, 6, 7]  # 4 from the block, 3 of its own columns
    whole = torch.cat([block_kv[0], torch.stack((own[1], own[1] + 0.5))[:, :, 2:]], dim=-2)
    assert torch.equal(kv(0)[0], whole)
    assert torch.equal(kv(2)[0], whole[..., 2:, :])
    assert torch.equal(kv(5)[0], whole[..., 5:, :])


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """An engine that shares prefixes and a cold one that prefills every prompt alone and
    whole (no prefix cache, no sharing), both serving the same adapter as version 1."""
    sharing = EmbeddedEngine("tiny", threads=1, share_prefixes=True)
    cold = EmbeddedEngine("tiny", threads=1, prefix_cache_tokens=0, share_prefixes=False)
    path = str(save_random_adapter(tmp_path_factory.mktemp("share") / "v1", seed=51))
    for engine in (sharing, cold):
        engine.load_adapter(path, 1)
    yield sharing, cold
    sharing.close()
    cold.close()


def prompt(engine, question, history=()):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return engine.encode(messages)


def run_together(engine, jobs):
    """Queues (prompt ids, on the policy) jobs into one prefill; returns what each ran."""
    queued = queued_together(engine, lambda: [submit(engine, ids, policy) for ids, policy in jobs])
    return [collect(one) for one in queued]


def assert_alone(cold, ids, policy, ran):
    alone = run_together(cold, [(ids, policy)])[0]
    assert ran.tokens == alone.tokens
    assert ran.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def count_shared_passes(monkeypatch):
    calls = []
    real = attention._with_shared_prefix

    def spy(module, query, *args):
        calls.append(query.shape[0])
        return real(module, query, *args)

    monkeypatch.setattr(attention, "_with_shared_prefix", spy)
    return calls


def test_rows_reading_one_system_prompt_get_what_each_gets_alone(engines, monkeypatch):
    sharing, cold = engines
    calls = count_shared_passes(monkeypatch)
    jobs = [(prompt(sharing, f"what is {n} + {2 * n}?"), True) for n in range(4)]
    results = run_together(sharing, jobs)
    block = sharing._scheduler._block
    assert block is not None and len(block.tokens) >= MIN_SHARED
    assert max(calls) == 4  # decode steps of all four rows read the block
    for (ids, policy), result in zip(jobs, results, strict=True):
        assert_alone(cold, ids, policy, result)


def test_a_group_of_identical_prompts_reads_all_but_their_last_token_from_the_block(engines):
    sharing, cold = engines
    ids = prompt(sharing, "what is 6 * 7?")
    results = run_together(sharing, [(ids, True)] * 4)  # a group's rollouts of one task
    block = sharing._scheduler._block
    assert block is not None and list(block.tokens) == ids
    for result in results:
        assert_alone(cold, ids, True, result)


def test_a_next_turn_reuses_the_whole_history_of_a_row_that_read_a_block(engines):
    sharing, cold = engines
    first = [prompt(sharing, f"what is {n} * 3?") for n in (7, 8)]
    results = run_together(sharing, [(ids, True) for ids in first])
    follow_up = sharing.encode([{"role": "user", "content": "and plus one?"}])
    second = first[0] + results[0].tokens + follow_up
    again = run_together(sharing, [(second, True)])[0]
    # every token the first turn fed back, the block's included: all but its last sampled
    assert again.cached == len(first[0]) + len(results[0].tokens) - 1
    assert_alone(cold, second, True, again)


def test_rows_of_another_version_read_no_block_of_this_one(engines, monkeypatch):
    sharing, cold = engines
    calls = count_shared_passes(monkeypatch)
    jobs = [(prompt(sharing, f"is {n} even?"), policy) for n in (3, 4) for policy in (False, True)]
    results = run_together(sharing, jobs)
    assert calls and max(calls) == 4  # every row decodes together...
    block = sharing._scheduler._block
    assert block is not None and block.key == (None, 0)  # ...the base rows' block
    for (ids, policy), result in zip(jobs, results, strict=True):
        assert_alone(cold, ids, policy, result)
    assert results[0].logprobs != pytest.approx(results[1].logprobs, abs=1e-3)  # the adapter tells


def test_no_block_is_read_when_sharing_is_off(engines, monkeypatch):
    _, cold = engines
    calls = count_shared_passes(monkeypatch)
    run_together(cold, [(prompt(cold, f"what is {n} - 1?"), True) for n in range(3)])
    assert calls == []


def test_a_row_decoding_before_the_block_was_picked_reads_it_too(engines, monkeypatch):
    """A row admitted alone (an evaluation's first request, say) is not left holding the
    prefix in its own cache when others join: that would keep every row's cache as wide."""
    sharing, cold = engines
    for engine in (sharing, cold):  # every row decodes to its max: the first is still running
        monkeypatch.setattr(engine._scheduler, "eos_ids", set())
    scheduler = sharing._scheduler
    scheduler.call(lambda: scheduler.prefixes.retain(set()))  # nothing cached: no block alone
    ids = [prompt(sharing, f"what is {n} + 5?") for n in range(4)]

    def submit_long(engine):  # 64 tokens: still decoding when the others are admitted
        events: queue.SimpleQueue = queue.SimpleQueue()
        return engine._scheduler.submit(ids[0], LONG, LONG.max_tokens, None, True, events), events

    first = queued_together(sharing, lambda: [submit_long(sharing)])
    assert scheduler.call(lambda: scheduler._batch is not None and scheduler._batch.shared == [0])
    rest = queued_together(sharing, lambda: [submit(sharing, row, True) for row in ids[1:]])

    def layout():
        batch = scheduler._batch
        return (len(batch.rows), list(batch.shared), batch.mask.shape[1]) if batch else (0, [], 0)

    rows, shared, width = scheduler.call(layout)
    while rows < 4:
        rows, shared, width = scheduler.call(layout)
    assert all(length >= MIN_SHARED for length in shared)  # the first row's too
    assert width < len(ids[0]) - MIN_SHARED  # no row's cache holds the prefix any more
    ran_first = collect(first[0])
    alone = collect(queued_together(cold, lambda: [submit_long(cold)])[0])
    assert ran_first.tokens == alone.tokens
    assert ran_first.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    for row, ran in zip(ids[1:], [collect(one) for one in rest], strict=True):
        assert_alone(cold, row, True, ran)
