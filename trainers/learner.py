"""The LoRA learner: one optimiser step from a batch of judged turns, versioned adapters,
and checkpoints that resume exactly.

The learner keeps its own copy of the base model with a peft LoRA adapter. For each step
it recomputes log-probs on the very token ids the engine sampled, never re-tokenized, and
accumulates the clipped policy loss over micro-batches normalised by the step's total token
count. A step is one optimiser update, so every micro-batch's forward pass runs on the
weights from before the step: the proximal log-probs of the PPO ratio are that pass's own
values, detached, rather than a second no-grad pass over the batch (a fifth of a step).
Log-probs are computed from the hidden states a chunk of positions at a time, with the
chunk recomputed in backward, so the full [tokens, vocabulary] logits never exist at once:
with SmolLM2's 49k vocabulary those logits, not the model, dominate a step's memory.
The entropy of each position's distribution is taken in the same chunk, without gradient.
Positions are computed once: the prefix all turns of a pass share (an agent's system prompt
and tools) runs as one row whose keys and values the others attend to, and an episode whose
turns extend one another runs as its last turn's row with every turn's tokens scored in
place (`trainer.share_prefix`, `trainer.pack_turns`). Gradient checkpointing is chosen per
pass from an estimate of its activations against a memory budget (`gradient_checkpointing`
auto).
With `trainer.kl_estimate` the learner keeps a frozen copy of the LoRA weights that RL
started from and scores the step's tokens under them in one no-grad pass, for an estimate
of how far the policy has moved (`StepMetrics.kl_to_start`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from agents import models
from trainers.advantages import truncated_importance_weights
from trainers.config import TrainerConfig, checkpointing_mode
from trainers.losses import (
    clip_fraction,
    clipped_policy_loss,
    entropy,
    k3_kl,
    kl_to_base,
    nll_loss,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSample:
    """One turn, ready to train on."""

    seq: int
    """The turn's sequence number in the store."""
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    advantages: tuple[float, ...]
    """One per completion token."""
    policy_version: int


@dataclass(frozen=True)
class StepMetrics:
    """What one optimiser step did."""

    step: int
    version: int
    turns: int
    tokens: int
    loss: float
    kl: float
    """The KL penalty to the base model (`trainer.kl_weight`; 0 without it)."""
    kl_to_start: float | None
    """KL(policy || the policy RL started from: the adapter at the switch from an SFT warm
    start, `trainer.init_adapter`, else the base model), the k3 estimate over the step's
    sampled tokens at the weights before the step: 0 at RL's first step. None: an SFT step
    (RL has not started), `trainer.kl_estimate` off, or a learner that cannot score them."""
    entropy: float | None
    """Mean entropy (nats) of the policy's full next-token distribution at the trained
    positions, at the weights before the step (an SFT step's too); None where the learner
    does not see the distribution (Tinker)."""
    clip_fraction: float
    """Share of the step's trained tokens whose ratio of the learner's probability (before
    the step) to the rollout's lies outside [1 - clip_low, 1 + clip_high]: those PPO clips
    with the rollout as its old policy (the Tinker learner's loss). This learner's own ratio,
    to the weights before the step, is 1 all through its one update, so never clips. High:
    the policy moves far between versions (steps too large) or the engine disagrees with
    the learner (`logprob_gap`). 0 for an SFT step."""
    mean_advantage: float
    logprob_gap: float
    """Mean |learner - rollout| log-prob over tokens of on-policy turns (sampled by the
    adapter being trained): the train / rollout mismatch."""
    logprob_gap_max: float
    """The largest |learner - rollout| log-prob of any one such token."""
    grad_norm: float
    seconds: float


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
    logprobs, entropies = [], []
    for row, start, end in spans:
        targets = ids[row, start:end]
        states = hidden[row, start - 1 : end - 1]
        pieces = [
            checkpoint(
                gather, head, states[i : i + chunk], targets[i : i + chunk], use_reentrant=False
            )
            for i in range(0, len(targets), chunk)
        ]
        logprobs.append(torch.cat([p[0] for p in pieces]) if pieces else torch.zeros(0))
        entropies.append(torch.cat([p[1] for p in pieces]) if pieces else torch.zeros(0))
    return logprobs, entropies


def _gather_logprobs(
    head: torch.nn.Module, states: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(states).float()
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0], torch.zeros(0)


def _gather_logprobs_and_entropy(
    head: torch.nn.Module, states: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(states).float()
    logsoftmax = torch.log_softmax(logits, dim=-1)
    gathered = logsoftmax.gather(-1, targets[:, None])[:, 0]
    # last, and without gradient: the recomputation in backward stops once it has the
    # tensors backward needs (non-reentrant checkpoint's early stop), before this
    with torch.no_grad():
        return gathered, entropy(logsoftmax)


def set_mmap_threshold(size: int) -> bool:
    """Fixes glibc's mmap threshold for this process; False where libc is not glibc.

    PyTorch's CPU allocator frees each tensor back to malloc. glibc raises its mmap
    threshold (up to 32 MiB) whenever a mapped block is freed, after which a step's
    activations come from the heap, and a fragmented heap keeps what was freed: a LoRA step
    on SmolLM2 at 8 x 512 tokens peaked at 5.5 GiB RSS that way, 1.45 GiB with the
    threshold fixed at 1 MiB, but took 1.4x as long, every large tensor then being a fresh
    mapping whose pages fault in again (`TrainerConfig.mmap_threshold_kb`). Setting it
    explicitly also turns the adaptation off.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, size)) and bool(mallopt(m_trim_threshold, size))


def activation_bytes(positions: int, model_config: Any, dtype_bytes: int) -> int:
    """Memory autograd keeps for backward over a pass of `positions` positions without
    gradient checkpointing: per layer and position, about 12 hidden-size tensors (norms,
    attention's inputs and outputs, the projections' inputs) and 5 intermediate-size ones
    (the gated MLP's), doubled for what the allocator holds beside them. Calibrated on
    SmolLM2-135M, fp32 on a CPU: 7.4 GiB peak resident for a pass of ~2,000 positions, where
    this says 7.0 GiB (the weights' 0.5 GiB aside)."""
    per_position = 12 * model_config.hidden_size + 5 * model_config.intermediate_size
    return 2 * positions * model_config.num_hidden_layers * per_position * dtype_bytes


def available_memory(device: torch.device) -> int:
    """Bytes free for the learner's activations now: the GPU's free memory, else the
    system's available memory (/proc/meminfo; free pages where there is none)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def learner_device(requested: str, cuda_available: bool) -> str:
    """Where the learner trains: `requested` (auto: cuda when present, else cpu)."""
    if requested == "cuda" and not cuda_available:
        raise ValueError(
            "trainer.device=cuda, but torch sees no CUDA device; use trainer.device=cpu"
        )
    if requested == "auto":
        return "cuda" if cuda_available else "cpu"
    return requested


def learner_dtype(requested: str, device: str, bf16_supported: bool) -> torch.dtype:
    """The base weights' dtype: `requested` (auto: bfloat16 on a GPU that has it, else
    float32; bf16 on this CPU is 50x slower than fp32)."""
    if requested == "auto":
        return torch.bfloat16 if device == "cuda" and bf16_supported else torch.float32
    return torch.bfloat16 if requested == "bfloat16" else torch.float32


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


class Learner:
    """LoRA training of a base model, publishing adapter versions.

    Args:
        model_name: the base model, as `agents.models.resolve` takes it.
        config: the trainer config.
        run_dir: adapters go to run_dir/adapters/v<N>, checkpoints to run_dir/checkpoints.
    """

    def __init__(self, model_name: str, config: TrainerConfig, run_dir: Path):
        from peft import LoraConfig, get_peft_model

        self.config, self.run_dir = config, Path(run_dir)
        if config.mmap_threshold_kb:
            set_mmap_threshold(config.mmap_threshold_kb * 1024)
        base, _ = models.load(model_name)
        cuda = torch.cuda.is_available()
        self.device = torch.device(learner_device(config.device, cuda))
        dtype = learner_dtype(
            config.dtype, self.device.type, cuda and torch.cuda.is_bf16_supported()
        )
        base = base.to(device=self.device, dtype=dtype)
        lora = LoraConfig(
            r=config.lora_rank,
            lora_alpha=config.lora_alpha,
            target_modules=list(config.target_modules),
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        )
        # peft keeps the adapter's weights in float32 under a bf16 base (autocast_adapter_dtype)
        self.model = get_peft_model(base, lora)
        self.checkpointing = checkpointing_mode(config.gradient_checkpointing)
        budget = config.memory_budget_gib
        self.memory_budget = (
            int(budget * 2**30) if budget is not None else available_memory(self.device) // 2
        )
        """`gradient_checkpointing=auto`: the activations a pass may keep, in bytes."""
        self._checkpointed = False
        self._checkpoint(self.checkpointing == "on")
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
        self.step_count = 0
        self.version = 0
        self.trained_seqs: tuple[int, ...] = ()
        self.ledger: list[list[int]] = []
        """The store seqs trained at each step, in order: checkpointed with the weights."""
        self._held_prefix: tuple[int, tuple[int, ...], list[Any]] | None = None
        self._last_scored: tuple[int, ...] | None = None
        """`logprobs`' prefix reuse: the kept prefix (version, tokens, keys and values)
        and the last sequence scored."""
        self.start_weights: dict[str, torch.Tensor] | None = None
        """A frozen copy of the LoRA weights of the first policy step, RL's start (the
        reference of `StepMetrics.kl_to_start`; `trainer.kl_estimate`): checkpointed."""

    def step(
        self, samples: list[TrainSample], objective: str = "policy", lr: float | None = None
    ) -> StepMetrics:
        """One optimiser step over `samples`; returns its metrics (the adapter is not saved).

        `objective`: policy, the clipped policy loss on the samples' advantages; nll, the
        negative log-likelihood of their tokens (supervised fine-tuning; the metrics' loss
        is then the mean per token, and advantages are ignored). `lr`: this step's learning
        rate (an SFT warm start's own); None: `trainer.lr`."""
        if objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {objective!r}; use one of {OBJECTIVES}")
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.lr if lr is None else lr
        started = time.monotonic()
        if objective == "policy" and self.config.kl_estimate and self.start_weights is None:
            self.start_weights = {name: p.detach().clone() for name, p in self._trainable()}
        sums = self.accumulate_gradients(samples, objective)
        norm = torch.nn.utils.clip_grad_norm_(
            [p for _, p in self._trainable()], self.config.grad_clip
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        self.version += 1
        self._held_prefix = None
        self.trained_seqs = tuple(s.seq for s in samples)
        self.ledger.append(list(self.trained_seqs))
        advantages = [a for s in samples for a in s.advantages]
        total = sum(len(s.completion_ids) for s in samples)
        return StepMetrics(
            step=self.step_count,
            version=self.version,
            turns=len(samples),
            tokens=total,
            loss=sums["loss"],
            kl=sums["kl"],
            kl_to_start=sums["kl_start"] if "kl_start" in sums else None,
            entropy=sums["entropy"] / total if total else None,
            clip_fraction=sums["clip"] / max(total, 1),
            mean_advantage=sum(advantages) / max(len(advantages), 1),
            logprob_gap=sums["gap"] / max(sums["gap_tokens"], 1),
            logprob_gap_max=sums["gap_max"],
            grad_norm=float(norm),
            seconds=round(time.monotonic() - started, 3),
        )

    def accumulate_gradients(
        self, samples: list[TrainSample], objective: str = "policy"
    ) -> dict[str, float]:
        """Backward passes over micro-batches of `samples`, gradients summed in place;
        returns the step's sums (`kl_start`, the k3 sum over tokens / total, only where the
        policy objective has RL's starting weights to score against)."""
        batches = self._micro_batches(samples)
        total = sum(len(s.completion_ids) for s in samples)
        names = ("loss", "kl", "entropy", "clip", "gap", "gap_max", "gap_tokens")
        sums: dict[str, float] = dict.fromkeys(names, 0.0) | {"batches": len(batches)}
        if objective == "nll":
            for batch in batches:
                self._fit_checkpointing(batch)
                rows, entropies = self._logprobs_and_entropy(batch)
                logprobs = _pad(rows)
                mask = _pad([torch.ones(len(s.completion_ids)) for s in batch]).to(logprobs.device)
                loss = nll_loss(logprobs, mask, total)
                loss.backward()
                sums["loss"] += loss.item()
                sums["entropy"] += float(sum(e.sum() for e in entropies))
            return sums
        base = self._base_logprobs(batches) if self.config.kl_weight else None
        start = None
        if self.start_weights is not None:
            start = self._start_logprobs(batches, self.start_weights)
            sums["kl_start"] = 0.0
        for index, batch in enumerate(batches):
            self._accumulate(
                batch,
                None if base is None else base[index],
                None if start is None else start[index],
                total,
                sums,
            )
        return sums

    def _accumulate(
        self,
        batch: list[TrainSample],
        base: list[torch.Tensor] | None,
        start: list[torch.Tensor] | None,
        total: int,
        sums: dict[str, float],
    ) -> None:
        self._fit_checkpointing(batch)
        logprobs, entropies = self._logprobs_and_entropy(batch)
        proximal = [row.detach() for row in logprobs]  # no update yet in this step
        current, prox = _pad(logprobs), _pad(proximal)
        device = current.device
        rollout = _pad([torch.tensor(s.rollout_logprobs) for s in batch]).to(device)
        advantages = _pad([torch.tensor(s.advantages) for s in batch]).to(device)
        mask = _pad([torch.ones(len(s.completion_ids)) for s in batch]).to(device)
        weights = truncated_importance_weights(prox, rollout, self.config.importance_cap)
        loss = clipped_policy_loss(
            current,
            prox,
            advantages,
            mask,
            total,
            self.config.clip_low,
            self.config.clip_high,
            weights * mask,
        )
        if base is not None:
            kl = kl_to_base(current, _pad(base), mask, total)
            loss = loss + self.config.kl_weight * kl
            sums["kl"] += kl.item()
        loss.backward()
        sums["loss"] += loss.item()
        if start is not None:
            sums["kl_start"] += k3_kl(prox, _pad(start), mask, total).item()
        sums["entropy"] += float(sum(e.sum() for e in entropies))
        # against the rollout: the ratio to `prox` is 1 all through this single update.
        # Token-weighted: the step's share, however the micro-batches split it.
        shares = clip_fraction(prox, rollout, mask, self.config.clip_low, self.config.clip_high)
        sums["clip"] += shares * float(mask.sum())
        for sample, learner_lp in zip(batch, proximal, strict=True):
            if sample.policy_version == self.version and sample.completion_ids:
                gaps = (learner_lp.float().cpu() - torch.tensor(sample.rollout_logprobs)).abs()
                sums["gap"] += float(gaps.sum())
                sums["gap_max"] = max(sums["gap_max"], float(gaps.max()))
                sums["gap_tokens"] += len(sample.completion_ids)

    def logprobs(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
        """Log-prob of each completion token after the prompt under the current adapter.

        One call after another (a demonstration's turns, each scored as it is played) begin
        with the same system prompt and tool schemas: the keys and values of the prefix a
        call shares with the one before are kept, for this adapter version, and calls that
        begin with it compute only their own tokens."""
        sequence = (*prompt_ids, *completion_ids)
        causal_lm = self.model.get_base_model()
        with torch.no_grad():
            held = self._scoring_prefix(causal_lm, sequence, len(prompt_ids))
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

    def _scoring_prefix(
        self, causal_lm: Any, sequence: tuple[int, ...], start: int
    ) -> tuple[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """The kept prefix (its tokens, each layer's keys and values) that `sequence` begins
        with, short of its first scored token; a new one where this call shares enough with
        the last (`MIN_SHARED_PREFIX`); None: no prefix to reuse."""
        held = self._held_prefix
        if held and held[0] == self.version and len(held[1]) < start:
            if sequence[: len(held[1])] == held[1]:
                return held[1], held[2]
        last, self._last_scored = self._last_scored, sequence
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
        self._held_prefix = (self.version, prefix, layers)
        return prefix, layers

    def _logprobs(self, batch: list[TrainSample]) -> list[torch.Tensor]:
        return self._logprobs_and_entropy(batch, with_entropy=False)[0]

    def _logprobs_and_entropy(
        self, batch: list[TrainSample], with_entropy: bool = True
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per sample of `batch`, its completion's log-probs (and entropies)."""
        groups = packed_turns(batch) if self.config.pack_turns else [[i] for i in range(len(batch))]
        sequences = [
            list(batch[g[0]].prompt_ids) + list(batch[g[0]].completion_ids) for g in groups
        ]
        spans, owners = [], []
        for row, group in enumerate(groups):
            for index in group:
                start = len(batch[index].prompt_ids)
                spans.append((row, start, start + len(batch[index].completion_ids)))
                owners.append(index)
        logprobs, entropies = span_logprobs_and_entropy(
            self.model.get_base_model(),
            sequences,
            spans,
            self.config.logprob_chunk,
            with_entropy,
            self._share_prefix,
        )
        order = sorted(range(len(owners)), key=owners.__getitem__)
        return [logprobs[i] for i in order], [entropies[i] for i in order]

    def _micro_batches(self, samples: list[TrainSample]) -> list[list[TrainSample]]:
        """The step's passes within `trainer.micro_batch_tokens`: rows (`packed_turns`,
        each with the turns it holds) in order of length, so that the rows of a pass pad
        little (the loss is a sum over tokens: the order does not change it)."""
        if self.config.pack_turns:
            rows = [[samples[i] for i in row] for row in packed_turns(samples)]
        else:
            rows = [[sample] for sample in samples]
        rows.sort(key=lambda row: len(row[0].prompt_ids) + len(row[0].completion_ids))
        batches: list[list[list[TrainSample]]] = []
        for row in rows:
            heads = [held[0] for held in [*(batches[-1] if batches else []), row]]
            budget = self.config.micro_batch_tokens
            sharing = self.config.share_prefix and self.checkpointing != "on"
            if not batches or padded_tokens(heads, sharing) > budget:
                batches.append([])
            batches[-1].append(row)
        return [[sample for row in batch for sample in row] for batch in batches]

    @property
    def _share_prefix(self) -> bool:
        # gradient checkpointing drops the prefix pass's cache in training
        return self.config.share_prefix and not self._checkpointed

    def _checkpoint(self, on: bool) -> None:
        if on != self._checkpointed:
            if on:
                self.model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
            else:
                self.model.gradient_checkpointing_disable()
            self._checkpointed = on

    def _fit_checkpointing(self, batch: list[TrainSample]) -> None:
        """`gradient_checkpointing=auto`: on for a pass over `batch` whose activations
        without it would pass the memory budget, off otherwise."""
        if self.checkpointing != "auto":
            return
        positions = padded_tokens(batch, self.config.share_prefix, self.config.pack_turns)
        dtype_bytes = next(self.model.parameters()).element_size()
        needed = activation_bytes(positions, self.model.get_base_model().config, dtype_bytes)
        self._checkpoint(needed > self.memory_budget)

    def _trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]

    def _base_logprobs(self, batches: list[list[TrainSample]]) -> list[list[torch.Tensor]]:
        """Log-probs under the base model (the adapter off), for the KL term."""
        with torch.no_grad(), self.model.disable_adapter():
            return [self._logprobs(b) for b in batches]

    def _start_logprobs(
        self, batches: list[list[TrainSample]], weights: dict[str, torch.Tensor]
    ) -> list[list[torch.Tensor]]:
        """Log-probs under the LoRA `weights` (RL's start), swapped in for one no-grad pass
        and back: the tensors trade places, nothing is copied."""
        params = self._trainable()
        current = [p.data for _, p in params]
        try:
            with torch.no_grad():
                for name, p in params:
                    p.data = weights[name]
                return [self._logprobs(b) for b in batches]
        finally:
            for (_, p), data in zip(params, current, strict=True):
                p.data = data

    # -- publishing and checkpoints ------------------------------------------------------
    def start_from(self, adapter: str | Path) -> Path:
        """Starts a fresh run from a trained LoRA adapter (`trainer.init_adapter`): its
        weights become the policy, served as version 1 (version 0 stays the base model, so
        that turns sampled with the adapter are told apart); returns adapters/v1.

        Raises:
            ValueError: no adapter there, or one shaped unlike this learner's LoRA.
        """
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        path = resolve_adapter(adapter)
        saved = json.loads((path / "adapter_config.json").read_text())
        mine = self.model.peft_config["default"]
        if saved.get("r") != mine.r or set(saved.get("target_modules") or ()) != set(
            mine.target_modules
        ):
            raise ValueError(
                f"the adapter at {path} has rank {saved.get('r')} on "
                f"{sorted(saved.get('target_modules') or ())}; this learner's is rank {mine.r} "
                f"on {sorted(mine.target_modules)}: set trainer.lora_rank and "
                "trainer.target_modules to match it"
            )
        result = set_peft_model_state_dict(
            self.model, load_file(path / "adapter_model.safetensors")
        )
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"the adapter at {path} has weights this model lacks")
        self.version, self._held_prefix = 1, None
        logger.info("starting from the adapter at %s (served as version 1)", path)
        return self.save_adapter()

    def save_adapter(self, name: str | None = None) -> Path:
        """Writes the current adapter as run_dir/adapters/v<version> (or run_dir/<name>);
        returns the directory."""
        target = self.run_dir / name if name else self.run_dir / "adapters" / f"v{self.version}"
        staging = target.with_name(target.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        self.model.save_pretrained(staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        return target

    def save_checkpoint(self, cursor: dict[str, Any]) -> Path:
        """Adapter, optimiser, step, version, RNG states, RL's starting weights and the
        caller's cursor, atomically: a crash mid-write leaves the previous checkpoint intact."""
        from safetensors.torch import save_file

        def write(staging: Path) -> dict[str, Any]:
            self.model.save_pretrained(staging / "adapter")
            if self.start_weights is not None:
                start = {name: w.cpu() for name, w in self.start_weights.items()}
                save_file(start, staging / START_WEIGHTS)
            torch.save(self.optimizer.state_dict(), staging / "optimizer.pt")
            rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
            torch.save(rng, staging / "rng.pt")
            return {
                "step": self.step_count,
                "version": self.version,
                "trained_seqs": list(self.trained_seqs),
                "ledger": self.ledger,
                "cursor": cursor,
            }

        return commit_checkpoint(self.run_dir, write)

    def load_checkpoint(self) -> dict[str, Any] | None:
        """Restores the newest complete checkpoint; returns its state (None if there is none)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        found = newest_checkpoint(self.run_dir)
        if found is None:
            return None
        set_peft_model_state_dict(
            self.model, load_file(found / "adapter" / "adapter_model.safetensors")
        )
        self.optimizer.load_state_dict(torch.load(found / "optimizer.pt", weights_only=False))
        rng = torch.load(found / "rng.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        state: dict[str, Any] = json.loads((found / "state.json").read_text())
        self.step_count, self.version = state["step"], state["version"]
        self._held_prefix = None
        self.trained_seqs = tuple(state["trained_seqs"])
        self.ledger = [list(seqs) for seqs in state["ledger"]]
        start = found / START_WEIGHTS
        if self.config.kl_estimate and start.exists():
            self.start_weights = load_file(start, device=str(self.device))
        logger.info(
            "resumed from %s at step %d (adapter v%d)", found, self.step_count, self.version
        )
        return state


OBJECTIVES = ("policy", "nll")
"""What `Learner.step` can minimise."""

START_WEIGHTS = "start.safetensors"
"""A checkpoint's copy of `Learner.start_weights` (absent before RL's first step)."""


def resolve_adapter(path: str | Path) -> Path:
    """An adapter directory from `path`: the directory itself (it holds
    adapter_config.json), or a run directory, whose newest adapters/v<N> is taken.

    Raises:
        ValueError: neither, saying what was found.
    """
    root = Path(path)
    if (root / "adapter_config.json").exists():
        return root
    versions = sorted(
        (d for d in (root / "adapters").glob("v*") if d.name[1:].isdigit()),
        key=lambda d: int(d.name[1:]),
    )
    if versions:
        return versions[-1]
    raise ValueError(
        f"{path} is neither a LoRA adapter (no adapter_config.json) nor a run directory "
        "with adapters/v<N>"
    )


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0.0)


def commit_checkpoint(run_dir: Path, write: Callable[[Path], dict[str, Any]]) -> Path:
    """A checkpoint of a learner in `run_dir/checkpoints/latest`, atomically: `write` fills
    a staging folder and returns the state saved beside it as state.json; the folder is
    fsync'd, then takes the place of the previous one, so a crash at any point leaves one
    complete checkpoint (`newest_checkpoint` finds it)."""
    root = run_dir / "checkpoints"
    staging, latest, previous = root / "staging", root / "latest", root / "previous"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    state = write(staging)
    (staging / "state.json").write_text(json.dumps(state))
    _fsync_tree(staging)
    shutil.rmtree(previous, ignore_errors=True)
    if latest.exists():
        latest.rename(previous)
    staging.rename(latest)
    shutil.rmtree(previous, ignore_errors=True)
    return latest


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The folder of the newest complete checkpoint in `run_dir` (None: there is none)."""
    root = run_dir / "checkpoints"
    complete = (d for d in (root / "latest", root / "previous") if (d / "state.json").exists())
    return next(complete, None)


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
