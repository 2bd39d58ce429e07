"""Prefix reuse for the embedded engine: the KV cache of token sequences it has computed, in
a radix tree per model version, bounded in tokens and evicted least recently used first.

A multi-turn agent's next prompt starts with its previous prompt and completion, and every
episode of an env starts with the same system prompt and tool schemas: a prompt whose first
tokens are held here is prefilled from where the held part ends (`agents.engines.batching`
does that). Sequences are keyed by what computed their KV, `(adapter slot, version)` or
`(None, 0)` for the base model: a request on one policy version never sees another's KV.

The tree shares common prefixes (SGLang's RadixAttention): each node holds a run of tokens
and their KV, one tensor of shape (layers, 2, kv heads, tokens, head dim), so the system
prompt that a hundred sequences share is held once. Each node owns its tensor (a split
copies both halves), so the tokens held are exactly the memory held. Readers get copies
(`match`'s pieces are concatenated into the batch's cache by the caller), so evicting a
node never breaks a running request. Single-threaded: the scheduler thread alone uses it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Collection, Iterator, Sequence

import torch

Key = tuple[str | None, int]
"""(adapter slot, policy version) whose weights computed the KV; (None, 0): the base model."""


class _Node:
    """A run of tokens following its parent's, with their KV."""

    __slots__ = ("tokens", "kv", "parent", "children", "used")

    def __init__(
        self, tokens: tuple[int, ...], kv: torch.Tensor | None, parent: _Node | None, used: int
    ):
        self.tokens, self.kv, self.parent, self.used = tokens, kv, parent, used
        self.children: dict[int, _Node] = {}
        """By the first token of each child's run."""


class PrefixCache:
    """KV of token sequences by key, at most `max_tokens` tokens in all (0: holds nothing).

    Args:
        max_tokens: the most tokens held over every key; the least recently matched or
            inserted sequences' ends go first.
    """

    def __init__(self, max_tokens: int):
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.tokens = 0
        """Tokens held now, over every key."""
        self._roots: dict[Key, _Node] = {}
        self._clock = itertools.count(1)

    def match(self, key: Key, tokens: Sequence[int]) -> tuple[int, list[torch.Tensor]]:
        """The longest prefix of `tokens` held under `key`: its length and its KV, in pieces
        (views: copy them before this cache changes) that concatenate along dimension -2."""
        node, length, pieces = self._roots.get(key), 0, []
        used = next(self._clock)
        while node is not None and length < len(tokens):
            child = node.children.get(tokens[length])
            if child is None:
                break
            common = _common(child.tokens, tokens, length)
            child.used = used
            assert child.kv is not None
            pieces.append(child.kv if common == len(child.tokens) else child.kv[..., :common, :])
            length += common
            node = child if common == len(child.tokens) else None
        return length, pieces

    def insert(
        self, key: Key, tokens: Sequence[int], kv_from: Callable[[int], torch.Tensor]
    ) -> None:
        """Holds `tokens`' KV under `key`. `kv_from(start)` gives the KV of `tokens[start:]`,
        (layers, 2, kv heads, tokens, head dim); it is called only for a part not held yet,
        and its tensor is kept as it is (give a copy). Evicts down to `max_tokens` after."""
        root = self._roots.setdefault(key, _Node((), None, None, 0))
        node, length = root, 0
        used = next(self._clock)
        while length < len(tokens) and (child := node.children.get(tokens[length])) is not None:
            common = _common(child.tokens, tokens, length)
            child.used = used
            if common < len(child.tokens):
                child = _split(child, common)
            node, length = child, length + common
        if 0 < len(tokens) - length <= self.max_tokens:
            leaf = _Node(tuple(tokens[length:]), kv_from(length), node, used)
            node.children[leaf.tokens[0]] = leaf
            self.tokens += len(leaf.tokens)
            self._evict()

    def retain(self, keys: Collection[Key]) -> None:
        """Drops every key but `keys` (versions no request can bind any more)."""
        for key in [k for k in self._roots if k not in keys]:
            self.tokens -= sum(len(node.tokens) for node in _below(self._roots.pop(key)))

    def _evict(self) -> None:
        """Drops least recently used leaves until at most `max_tokens` are held."""
        if self.tokens <= self.max_tokens:
            return
        order = itertools.count()
        leaves = [
            (node.used, next(order), node)
            for root in self._roots.values()
            for node in _below(root)
            if not node.children
        ]
        heapq.heapify(leaves)
        while self.tokens > self.max_tokens:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            assert parent is not None
            del parent.children[node.tokens[0]]
            self.tokens -= len(node.tokens)
            if not parent.children and parent.parent is not None:
                heapq.heappush(leaves, (parent.used, next(order), parent))


def _common(held: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    """How many of `held` equal `tokens` from `start` on."""
    count = 0
    for mine, theirs in zip(held, itertools.islice(tokens, start, None), strict=False):
        if mine != theirs:
            break
        count += 1
    return count


def _split(node: _Node, at: int) -> _Node:
    """Cuts `node` after `at` tokens; returns the new upper half (the lower keeps `node`'s
    children). Both halves get their own copy, so that evicting one frees its memory."""
    assert node.parent is not None and node.kv is not None
    upper = _Node(node.tokens[:at], node.kv[..., :at, :].clone(), node.parent, node.used)
    node.parent.children[upper.tokens[0]] = upper
    node.tokens, node.kv, node.parent = node.tokens[at:], node.kv[..., at:, :].clone(), upper
    upper.children[node.tokens[0]] = node
    return upper


def _below(root: _Node) -> Iterator[_Node]:
    """Every node under `root` (not `root` itself)."""
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())
