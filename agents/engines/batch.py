"""The embedded engine's batch: the requests decoded together, their KV cache and mask, and
what happens to them when rows join (`merge`), leave (`drop`) or read a shared prefix
(`share`). The scheduler that drives them is `agents.engines.batching`.

A shared prefix (`SharedBlock`): the first tokens that many rows' prompts have in common (an
agent's system prompt and tool schemas, ~270 tokens of the main job's 300-token prompt),
held once. A row that reads it has those tokens' columns taken out of its own cache; its
decode steps attend to the block and to its cache together (`agents.engines.attention.
SharedPrefix`). The batch holds at most one block, chosen when rows join a batch in which
no row reads one: the longest prefix the joining rows of one adapter version have in
common (one row alone: the part of its prompt the prefix cache gave it), and the rows
already decoding that start with it read it from then on too. A new policy
version's rows cannot read an older version's block (its KV is another adapter's); they
read none until the older rows have left and a block of their own is chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from agents.engines.base import SamplingParams
from agents.engines.kv_layout import add_rows, compact_rows, drop_rows, row_kv, trim_columns
from agents.engines.prefix_cache import Key

MIN_SHARED = 32
"""Fewest tokens a row reads from a shared block (below it the row keeps them in its own
cache: the two-part attention would cost more than it saves)."""

PREFILL_PASS_TOKENS = 32
"""What one more prefill pass costs, in prompt tokens computed: on SmolLM2-135M (2-core CPU)
a one-row pass of 28 tokens took 0.14 s and a 20-row pass of 26 columns 1.2 s, so a pass
costs about 75 ms of its own beside 2.3 ms a column of a row, or 32 columns."""

END = object()
"""Put on a request's queue after its last token."""


class EventSink(Protocol):
    """Takes a request's items on the scheduler thread; must not block."""

    def put(self, item: Any) -> None: ...


@dataclass(eq=False)
class Request:
    """One sequence being generated; its sampled tokens go to `events` as they come."""

    prompt_ids: list[int]
    sampling: SamplingParams
    max_new: int
    stopped: Callable[[list[int]], bool] | None
    adapter: str | None
    """The peft adapter it runs on to its end; None for the base model."""
    version: int
    events: EventSink
    """Where its tokens, then `END` (or an exception), are put: a queue for a caller that
    blocks, an `agents.engines.aio.LoopSink` for one on an event loop."""
    generator: torch.Generator | None = None
    cached: int = 0
    """Prompt tokens whose KV came from the prefix cache, not from its prefill."""
    ids: list[int] = field(default_factory=list)
    cancelled: bool = False
    retired: bool = False
    """Out of the scheduler: its slot no longer counts it as a user."""

    def record(self, token: int, logprob: float, top: Any, eos_ids: set[int]) -> bool:
        """Hands a sampled token (with its position's top ids and log-probs, or None) to the
        consumer; True when the sequence is finished."""
        self.ids.append(token)
        self.events.put((token, logprob, top))
        done = (
            token in eos_ids
            or len(self.ids) >= self.max_new
            or (self.stopped is not None and self.stopped(self.ids))
        )
        if done:
            self.events.put(END)
        return done


@dataclass
class Batch:
    """Rows decoded together: one KV cache, left-padded to common columns."""

    rows: list[Request]
    cache: Cache
    mask: torch.Tensor
    """(rows, columns): 1 for a real token in the row's cache, 0 for padding."""
    last: list[int]
    """Each row's latest sampled token, fed at the next step."""
    shared: list[int] = field(default_factory=list)
    """Each row's first tokens read from the batch's shared block (0: none), which its
    cache does not hold."""

    def positions(self) -> torch.Tensor:
        """(rows, 1): each row's next position (its tokens so far, the shared ones too)."""
        positions = self.mask.sum(-1, keepdim=True)
        return positions + torch.tensor(self.shared)[:, None] if any(self.shared) else positions


@dataclass(frozen=True)
class SharedBlock:
    """A prompt prefix's KV held once for the rows that start with it."""

    key: Key
    """The (adapter slot, version) whose weights computed it: only its rows read it."""
    tokens: tuple[int, ...]
    kv: torch.Tensor
    """(layers, 2, kv heads, tokens, head dim)."""


def pick_block(fresh: Batch) -> SharedBlock | None:
    """A block for rows joining a batch in which no row reads one: the longest prefix the
    joining rows of the first one's version share (one row alone: the part of its prompt the
    prefix cache gave it), or None when that is under `MIN_SHARED` tokens."""
    key = _key(fresh.rows[0])
    mine = [i for i, r in enumerate(fresh.rows) if _key(r) == key]
    prompts = [fresh.rows[i].prompt_ids for i in mine]
    length = common_length(prompts) if len(mine) > 1 else fresh.rows[0].cached
    if length < MIN_SHARED:
        return None
    first = mine[0]
    columns = fresh.mask[first].nonzero()[:length, 0]
    return SharedBlock(key, tuple(prompts[0][:length]), row_kv(fresh.cache, first, columns))


def share(fresh: Batch, block: SharedBlock) -> Batch:
    """The joining rows, each reading the first tokens it has in common with `block` (at
    least `MIN_SHARED`, same version, all but its prompt's last token at most) from it: those
    columns leave its cache, the rest of
    every row is moved to the right end (no padding inside a row), and the columns no row
    uses any more are dropped."""
    shared = []
    for request in fresh.rows:
        same_version = _key(request) == block.key
        length = common_length([block.tokens, request.prompt_ids]) if same_version else 0
        # a row keeps at least its prompt's last token (a group's rollouts share the whole
        # prompt): a row with nothing of its own would have no columns to trim around
        length = min(length, len(request.prompt_ids) - 1)
        shared.append(length if length >= MIN_SHARED else 0)
    if not any(shared):
        return replace(fresh, shared=shared)
    mask = fresh.mask.clone()
    for row, length in enumerate(shared):
        mask[row, mask[row].nonzero()[:length, 0]] = 0
    mask = compact_rows(fresh.cache, mask)
    start = int(mask.any(0).nonzero()[0])
    if start:
        trim_columns(fresh.cache, start)
    return replace(fresh, mask=mask[:, start:], shared=shared)


def kv_from(
    batch: Batch, row: int, block: SharedBlock | None
) -> tuple[list[int], Callable[[int], torch.Tensor]]:
    """A row's tokens so far (prompt, then each token fed back) and a function giving their
    KV from a token on, (layers, 2, kv heads, tokens, head dim), for the prefix cache."""
    request, length = batch.rows[row], batch.shared[row]
    columns = batch.mask[row].nonzero()[:, 0]  # its own tokens' columns, in order
    tokens = (request.prompt_ids + request.ids)[: length + len(columns)]

    def kv(start: int) -> torch.Tensor:
        own = row_kv(batch.cache, row, columns[max(start - length, 0) :])
        if start >= length:
            return own
        assert block is not None
        return torch.cat([block.kv[..., start:length, :], own], dim=-2)

    return tokens, kv


def _key(request: Request) -> Key:
    return (request.adapter, request.version)


def common_length(sequences: Sequence[Sequence[int]]) -> int:
    """How many first tokens all `sequences` have in common."""
    count = 0
    for column in zip(*sequences, strict=False):
        if any(token != column[0] for token in column):
            break
        count += 1
    return count


def prefill_passes(
    widths: Sequence[int], pass_tokens: int = PREFILL_PASS_TOKENS
) -> list[list[int]]:
    """Splits the rows of a prefill, of `widths` prompt tokens left to compute each, into
    passes (indices into `widths`) at the least cost, a pass costing `pass_tokens` plus its
    rows times its widest row's width: every row of a pass is left-padded to that width,
    and padding costs as much as a token. An evaluation's next turns (30 new tokens each)
    that arrive with a rollout whose prompt a new policy version must prefill whole (350)
    would otherwise all be computed 350 wide.

    Rows of similar width share a pass: in order of width, the best passes are runs of
    neighbours, found by dynamic programming over where each pass ends (`n` rows: n^2/2
    steps). Passes come narrowest first.
    """
    order = sorted(range(len(widths)), key=widths.__getitem__)
    best = [0] * (len(order) + 1)
    start_of = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        widest = widths[order[end - 1]]
        costs = [best[start] + pass_tokens + (end - start) * widest for start in range(end)]
        start_of[end] = min(range(end), key=costs.__getitem__)
        best[end] = costs[start_of[end]]
    passes, end = [], len(order)
    while end:
        passes.append(order[start_of[end] : end])
        end = start_of[end]
    return passes[::-1]


@dataclass(frozen=True)
class Layout:
    """One row of a prefill: `past` columns of reused prefixes, where this row's `cached`
    tokens end, then `width` columns, where the rest of its prompt ends."""

    prompt: list[int]
    cached: int
    past: int
    width: int

    @property
    def ids(self) -> list[int]:
        rest = self.prompt[self.cached :]
        return [0] * (self.width - len(rest)) + rest

    @property
    def mask(self) -> list[int]:
        rest = len(self.prompt) - self.cached
        gaps = (self.past - self.cached, self.width - rest)
        return [0] * gaps[0] + [1] * self.cached + [0] * gaps[1] + [1] * rest

    @property
    def positions(self) -> list[int]:
        return [0] * (self.width - len(self.prompt) + self.cached) + list(
            range(self.cached, len(self.prompt))
        )


def drop(batch: Batch, gone: list[bool]) -> Batch | None:
    """The batch without the rows flagged `gone` (the cache changed in place: the last rows
    move into the gaps), trimmed of all-padding columns."""
    if not any(gone):
        return batch
    if all(gone):
        return None
    order = drop_rows(batch.cache, gone)
    mask = batch.mask[torch.tensor(order)]
    start = int(mask.any(0).nonzero()[0])
    if start:
        trim_columns(batch.cache, start)
    rows, last = [batch.rows[i] for i in order], [batch.last[i] for i in order]
    shared = [batch.shared[i] for i in order]
    return Batch(rows, batch.cache, mask[:, start:], last, shared)


def merge(batch: Batch | None, fresh: Batch | None, max_rows: int) -> Batch | None:
    """Both batches' rows in one (the first one's cache grown in place), each left-padded to
    the longer one's columns."""
    if batch is None or fresh is None:
        return batch or fresh
    grown = add_rows(batch.cache, fresh.cache, max_rows)
    width = batch.mask.shape[1] + grown
    mask = torch.cat(
        [
            F.pad(batch.mask, (grown, 0)),
            F.pad(fresh.mask, (width - fresh.mask.shape[1], 0)),
        ]
    )
    return Batch(
        batch.rows + fresh.rows,
        batch.cache,
        mask,
        batch.last + fresh.last,
        batch.shared + fresh.shared,
    )
