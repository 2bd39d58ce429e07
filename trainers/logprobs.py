"""Log-probs of the very token ids a turn was sampled with, computed from the decoder's
hidden states a chunk of positions at a time (the full [tokens, vocabulary] logits never
exist at once), and how a step's turns are laid out in passes: rows that share a prefix run
it once (`decoder_states`), turns that extend one another run as one row (`packed_turns`),
passes stay within a token budget (`micro_batches`, `padded_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from agents.vision import PixelInputs, Pixels, forward_inputs, markup_ids, masked_logits
from trainers.learning import TrainSample
from trainers.losses import entropy

MIN_SHARED_PREFIX = 32
"""Shortest common prefix worth a pass of its own (`shared_prefix_length`)."""


def token_logprobs(
    causal_lm: Any,
    sequences: list[list[int]],
    starts: list[int],
    chunk: int,
    share_prefix: bool = False,
) -> list[torch.Tensor]:
    """Log-probs of tokens `starts[i]:` of each sequence, given all tokens before them.

    Right-padded batch; only the hidden states are materialised for the whole batch, the
    vocabulary projection runs `chunk` positions at a time (and again in backward).
    `share_prefix`: the tokens every sequence starts with run once (`decoder_states`).
    """
    return token_logprobs_and_entropy(
        causal_lm, sequences, starts, chunk, with_entropy=False, share_prefix=share_prefix
    )[0]


def shared_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """How many leading tokens all `sequences` have in common, leaving each at least one
    token of its own; 0 below `MIN_SHARED_PREFIX` (a pass of its own would not pay)."""
    first, limit = sequences[0], min(len(s) for s in sequences) - 1
    length = 0
    while length < limit and all(s[length] == first[length] for s in sequences[1:]):
        length += 1
    return length if length >= MIN_SHARED_PREFIX else 0


def decoder_states(
    causal_lm: Any, ids: torch.Tensor, mask: torch.Tensor, shared: int
) -> torch.Tensor:
    """The decoder's last hidden states of a right-padded batch, [rows, width, hidden].

    `shared` > 0: the batch's first `shared` tokens are the same in every row (an agent's
    system prompt and tool schemas, most of a turn's tokens). They run once, as one row,
    and the rest of each row attends to their keys and values from the cache, repeated per
    row; gradients from every row flow back into the one pass. The same function as the
    full pass (the cache's keys are the ones the full pass computes at those positions),
    at a fraction of the work when the prefix dominates. Not under gradient checkpointing,
    which drops the cache in training.
    """
    decoder = causal_lm.get_decoder()
    if not shared or len(ids) == 1:
        return decoder(input_ids=ids, attention_mask=mask).last_hidden_state
    head = decoder(input_ids=ids[:1, :shared], use_cache=True)
    cache = head.past_key_values
    cache.batch_repeat_interleave(len(ids))
    positions = torch.arange(shared, ids.shape[1], device=ids.device).expand(len(ids), -1)
    rest = decoder(
        input_ids=ids[:, shared:],
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
    ).last_hidden_state
    prefix = head.last_hidden_state.expand(len(ids), -1, -1)
    return torch.cat([prefix, rest], dim=1)


def padded_states(causal_lm: Any, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
    """The decoder's last hidden states of token sequences of any lengths, right-padded into
    one batch on the head's device, [rows, longest, hidden]."""
    width = max(map(len, sequences))
    device = causal_lm.get_output_embeddings().weight.device
    ids = torch.zeros(len(sequences), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
    return decoder_states(causal_lm, ids, mask, 0)


def token_logprobs_and_entropy(
    causal_lm: Any,
    sequences: list[list[int]],
    starts: list[int],
    chunk: int,
    with_entropy: bool = True,
    share_prefix: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`token_logprobs`, and the entropy of the distribution at each of those positions
    (no gradient; empty tensors without `with_entropy`), from the same chunk's log-softmax.
    """
    spans = [
        (row, start, len(s)) for row, (s, start) in enumerate(zip(sequences, starts, strict=True))
    ]
    return span_logprobs_and_entropy(causal_lm, sequences, spans, chunk, with_entropy, share_prefix)


def span_logprobs_and_entropy(
    causal_lm: Any,
    sequences: list[list[int]],
    spans: Sequence[tuple[int, int, int]],
    chunk: int,
    with_entropy: bool = True,
    share_prefix: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Log-probs (and entropies) of the tokens of each span (row, start, end): tokens
    `start:end` of `sequences[row]`, given all tokens before them. A row may hold several
    spans: a multi-turn episode's turns, each inside the next (`packed_turns`)."""
    logprobs, entropies, _ = span_logprobs_at(
        causal_lm, sequences, spans, chunk, with_entropy, share_prefix
    )
    return logprobs, entropies


def span_logprobs_at(
    causal_lm: Any,
    sequences: list[list[int]],
    spans: Sequence[tuple[int, int, int]],
    chunk: int,
    with_entropy: bool = True,
    share_prefix: bool = False,
    extra_ids: Sequence[torch.Tensor | None] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor | None]]:
    """`span_logprobs_and_entropy`, and for each span with `extra_ids` ([tokens, m] ids, a
    top-k set a position) the log-probs of those ids at each of its positions ([tokens, m],
    with gradient), gathered from the same chunk's log-softmax: no second pass."""
    extra_ids = extra_ids or [None] * len(spans)
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
    device = causal_lm.get_output_embeddings().weight.device
    ids, mask = ids.to(device), mask.to(device)
    shared = shared_prefix_length(sequences) if share_prefix else 0
    hidden = decoder_states(causal_lm, ids, mask, shared)
    head = causal_lm.get_output_embeddings()
    gather = _gather_logprobs_and_entropy if with_entropy else _gather_logprobs
    logprobs, entropies, extras = [], [], []
    for (row, start, end), extra in zip(spans, extra_ids, strict=True):
        targets = ids[row, start:end, None]
        if extra is not None:  # the sampled token first, then the set's
            targets = torch.cat([targets, extra.to(device)], dim=1)
        states = hidden[row, start - 1 : end - 1]
        pieces = [
            checkpoint(
                gather, head, states[i : i + chunk], targets[i : i + chunk], use_reentrant=False
            )
            for i in range(0, len(targets), chunk)
        ]
        gathered = torch.cat([p[0] for p in pieces]) if pieces else torch.zeros(targets.shape)
        logprobs.append(gathered[:, 0])
        extras.append(None if extra is None else gathered[:, 1:])
        entropies.append(torch.cat([p[1] for p in pieces]) if pieces else torch.zeros(0))
    return logprobs, entropies, extras


def vision_logprobs_and_entropy(
    model: Any,
    pixels: Pixels,
    samples: Sequence[TrainSample],
    chunk: int,
    with_entropy: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`span_logprobs_and_entropy` for a vision-language model: each sample's completion
    scored in a pass of its own, with its images' pixels and M-RoPE positions built as the
    engine built them (`agents.vision.forward_inputs`), the pixels preprocessed once per
    image (`Pixels` caches them). No packing or prefix sharing: two prompts with the same
    ids may hold different images."""
    head = vision_head(model)
    gather = _gather_logprobs_and_entropy if with_entropy else _gather_logprobs
    logprobs, entropies = [], []
    for sample in samples:
        sequence = [*sample.prompt_ids, *sample.completion_ids]
        hidden = vision_states(model, sequence, pixels(sample.images))
        start, end = len(sample.prompt_ids), len(sequence)
        targets = torch.tensor(sequence[start:end], device=hidden.device)
        states = hidden[start - 1 : end - 1]
        pieces = [
            checkpoint(
                gather,
                head,
                states[i : i + chunk],
                targets[i : i + chunk, None],
                use_reentrant=False,
            )
            for i in range(0, len(targets), chunk)
        ]
        logprobs.append(torch.cat([p[0][:, 0] for p in pieces]) if pieces else torch.zeros(0))
        entropies.append(torch.cat([p[1] for p in pieces]) if pieces else torch.zeros(0))
    return logprobs, entropies


def vision_states(model: Any, sequence: Sequence[int], pixels: PixelInputs | None) -> torch.Tensor:
    """A vision-language model's last hidden states over one token sequence [len, hidden],
    with its images' pixels and M-RoPE positions built as the engine built them
    (`agents.vision.forward_inputs`: ValueError where placeholders and images disagree)."""
    device = model.get_output_embeddings().weight.device
    ids = torch.tensor([list(sequence)], device=device)
    inputs = forward_inputs(model, ids, torch.ones_like(ids), pixels)
    return model.model(input_ids=ids, **inputs).last_hidden_state[0]


def vision_head(model: Any) -> torch.nn.Module:
    """A vision-language model's output projection with its markup tokens masked, as the
    engine samples (`agents.vision.markup_ids`)."""
    return _MaskedHead(model.get_output_embeddings(), torch.tensor(markup_ids(model.config)))


class _MaskedHead(torch.nn.Module):
    """The output projection with a VL model's markup tokens at -inf, as the engine samples
    (`agents.vision.markup_ids`)."""

    def __init__(self, head: torch.nn.Module, banned: torch.Tensor):
        super().__init__()
        self.head, self.banned = head, banned

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return masked_logits(self.head(states), self.banned)


def _gather_logprobs(
    head: torch.nn.Module, states: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(states).float()
    return torch.log_softmax(logits, dim=-1).gather(-1, targets), torch.zeros(0)


def _gather_logprobs_and_entropy(
    head: torch.nn.Module, states: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(states).float()
    logsoftmax = torch.log_softmax(logits, dim=-1)
    gathered = logsoftmax.gather(-1, targets)
    # last, and without gradient: the recomputation in backward stops once it has the
    # tensors backward needs (non-reentrant checkpoint's early stop), before this
    with torch.no_grad():
        return gathered, entropy(logsoftmax)


def packed_turns(samples: Sequence[TrainSample]) -> list[list[int]]:
    """Rows to run for `samples`, as indices: each row's first sample is the longest, and
    every other sample's tokens (prompt and completion) begin that one's. A multi-turn
    episode whose turns extend one another token for token (an agent's turn 2 prompt is
    turn 1's prompt, completion and the tool's reply) runs as one row, its last turn, every
    earlier turn's completion scored where it sits: the same log-probs, a fraction of the
    positions. Rows come in order of their first sample in `samples`."""
    sequences = [(*s.prompt_ids, *s.completion_ids) for s in samples]
    longest_first = sorted(range(len(samples)), key=lambda i: -len(sequences[i]))
    rows: list[list[int]] = []
    for index in longest_first:
        sequence = sequences[index]
        for row in rows:
            if sequences[row[0]][: len(sequence)] == sequence:
                row.append(index)
                break
        else:
            rows.append([index])
    return sorted(rows, key=lambda row: min(row))


def micro_batches(
    samples: list[TrainSample], token_budget: int, share_prefix: bool = False
) -> list[list[TrainSample]]:
    """Consecutive groups whose padded size (`padded_tokens`) stays within the budget."""
    batches: list[list[TrainSample]] = []
    current: list[TrainSample] = []
    for sample in samples:
        if current and padded_tokens([*current, sample], share_prefix) > token_budget:
            batches.append(current)
            current = []
        current.append(sample)
    return [*batches, current] if current else batches


def padded_tokens(
    batch: Sequence[TrainSample], share_prefix: bool = False, pack: bool = False
) -> int:
    """Positions one pass over `batch` computes: rows x the longest (right-padded); with
    `pack`, a row per `packed_turns` row; with `share_prefix`, the common prefix once."""
    sequences = [(*s.prompt_ids, *s.completion_ids) for s in batch]
    if pack:
        sequences = [sequences[row[0]] for row in packed_turns(batch)]
    longest = max(len(s) for s in sequences)
    shared = shared_prefix_length(sequences) if share_prefix else 0
    return shared + len(sequences) * (longest - shared)


def pad_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0.0)


class PrefixScorer:
    """Log-probs of completions scored one call after another (a demonstration's turns,
    each as it is played), which begin with the same system prompt and tool schemas: the
    keys and values of the prefix a call shares with the one before are kept, for one
    adapter version, and calls that begin with it compute only their own tokens."""

    def __init__(self, device: torch.device):
        self.device = device
        self._held: tuple[int, tuple[int, ...], list[Any]] | None = None
        """The kept prefix: the version it was computed at, its tokens, each layer's keys
        and values."""
        self._last: tuple[int, ...] | None = None
        """The last sequence scored."""

    def forget(self) -> None:
        """Drops the kept prefix (the weights changed)."""
        self._held = None

    def __call__(
        self,
        causal_lm: Any,
        version: int,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
    ) -> list[float]:
        """Log-prob of each completion token after the prompt (no gradient)."""
        from transformers import DynamicCache

        sequence = (*prompt_ids, *completion_ids)
        with torch.no_grad():
            held = self._prefix(causal_lm, version, sequence, len(prompt_ids))
            length = len(held[0]) if held else 0
            ids = torch.tensor([sequence[length:]], device=self.device)
            positions = torch.arange(length, len(sequence), device=self.device)[None]
            cache = DynamicCache(ddp_cache_data=held[1]) if held else None
            hidden = causal_lm.get_decoder()(
                input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=False
            ).last_hidden_state[0]
            states = hidden[len(prompt_ids) - length - 1 : len(sequence) - length - 1]
            logits = causal_lm.get_output_embeddings()(states).float()
            targets = torch.tensor(completion_ids, device=self.device)
            values = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
        return [float(x) for x in values.cpu()]

    def _prefix(
        self, causal_lm: Any, version: int, sequence: tuple[int, ...], start: int
    ) -> tuple[tuple[int, ...], list[Any]] | None:
        """The kept prefix (its tokens, each layer's keys and values) that `sequence` begins
        with, short of its first scored token; a new one where this call shares enough with
        the last (`MIN_SHARED_PREFIX`); None: no prefix to reuse."""
        held = self._held
        if held and held[0] == version and len(held[1]) < start:
            if sequence[: len(held[1])] == held[1]:
                return held[1], held[2]
        last, self._last = self._last, sequence
        if last is None:
            return None
        shared = min(shared_prefix_length([last, sequence]), start - 1)
        if shared < MIN_SHARED_PREFIX:
            return None
        prefix = sequence[:shared]
        out = causal_lm.get_decoder()(
            input_ids=torch.tensor([prefix], device=self.device), use_cache=True
        )
        layers = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        self._held = (version, prefix, layers)
        return prefix, layers
