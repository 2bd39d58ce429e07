"""The prefix cache's radix tree: shared prefixes held once, the right KV for every prefix,
never more tokens than its bound, least recently used sequences evicted first."""

from __future__ import annotations

import random

import pytest
import torch

from agents.engines.prefix_cache import PrefixCache

BASE_KEY = (None, 0)


def kv(tokens):
    """KV that says which token it belongs to: every value of a token's column is its id."""
    column = torch.tensor(tokens, dtype=torch.float32)
    return column[None, None, None, :, None].expand(2, 2, 1, len(tokens), 3).clone()


def insert(cache, tokens, key=BASE_KEY, asked=None):
    def kv_from(start):
        if asked is not None:
            asked.append(start)
        return kv(tokens[start:])

    cache.insert(key, tokens, kv_from)


def matched(cache, tokens, key=BASE_KEY):
    """(length, the token ids the returned KV belongs to)."""
    length, pieces = cache.match(key, tokens)
    if not pieces:
        return length, []
    return length, torch.cat(pieces, dim=-2)[0, 0, 0, :, 0].int().tolist()


def held(cache):
    """Tokens of KV the tree's nodes really hold."""
    stack = list(cache._roots.values())
    total = 0
    while stack:
        node = stack.pop()
        total += 0 if node.kv is None else node.kv.shape[-2]
        stack.extend(node.children.values())
    return total


def test_shared_prefixes_are_held_once_and_each_prefix_gets_its_own_kv():
    cache = PrefixCache(100)
    asked = []
    insert(cache, [1, 2, 3, 4], asked=asked)
    insert(cache, [1, 2, 5, 6], asked=asked)
    insert(cache, [1, 2, 5], asked=asked)
    assert asked == [0, 2]  # only the part not held is asked for
    assert cache.tokens == held(cache) == 6
    assert matched(cache, [1, 2, 5, 6, 7]) == (4, [1, 2, 5, 6])
    assert matched(cache, [1, 2, 3, 9]) == (3, [1, 2, 3])
    assert matched(cache, [9, 1, 2]) == (0, [])
    assert matched(cache, [1, 2, 3], key=("slot0", 1)) == (0, [])


def test_the_bound_is_never_exceeded_and_the_least_recently_used_go_first():
    cache = PrefixCache(10)
    insert(cache, [1, 2, 3, 4])
    insert(cache, [5, 6, 7, 8])
    matched(cache, [1, 2, 3, 4])  # the first is now the more recent
    insert(cache, [9, 10, 11, 12])
    assert cache.tokens == held(cache) == 8
    assert matched(cache, [5, 6, 7, 8]) == (0, [])
    assert matched(cache, [1, 2, 3, 4])[0] == matched(cache, [9, 10, 11, 12])[0] == 4


def test_a_sequence_longer_than_the_bound_is_not_held():
    cache = PrefixCache(3)
    insert(cache, [1, 2, 3, 4])
    assert cache.tokens == held(cache) == 0


def test_many_random_sequences_stay_within_the_bound_with_the_right_kv():
    rng = random.Random(0)
    cache = PrefixCache(200)
    for _ in range(500):
        # few distinct tokens: many shared prefixes, splits and evictions
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        length, ids = matched(cache, tokens)
        assert ids == tokens[:length]
        insert(cache, tokens, key=(None, rng.randrange(2)))
        assert cache.tokens == held(cache) <= 200


def test_retain_drops_other_keys_and_their_tokens():
    cache = PrefixCache(100)
    insert(cache, [1, 2, 3])
    insert(cache, [1, 2, 3, 4], key=("slot0", 1))
    cache.retain({BASE_KEY})
    assert cache.tokens == held(cache) == 3
    assert matched(cache, [1, 2, 3, 4], key=("slot0", 1)) == (0, [])


def test_a_negative_bound_is_refused():
    with pytest.raises(ValueError, match="max_tokens"):
        PrefixCache(-1)
