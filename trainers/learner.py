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
started from and scores some of the step's turns under them (`kl_estimate_turns`, spread
over the step) in one no-grad pass, for an estimate of how far the policy has moved
(`StepMetrics.kl_to_start`).
The pieces live beside it: the records and the learner type in `trainers.learning`, log-probs
and the layout of passes in `trainers.logprobs`, the model's placement in `trainers.lora`,
checkpoints on disk in `trainers.checkpoints`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from agents import models
from agents.vision import Pixels
from trainers.advantages import truncated_importance_weights
from trainers.checkpoints import (
    START_WEIGHTS,
    load_adapter,
    load_lora_checkpoint,
    newest_checkpoint,
    save_adapter_dir,
    save_lora_checkpoint,
)
from trainers.config import TrainerConfig, checkpointing_mode
from trainers.learning import OBJECTIVES, StepMetrics, TrainSample
from trainers.logprobs import (
    PrefixScorer,
    packed_turns,
    pad_rows,
    padded_tokens,
    span_logprobs_at,
    vision_logprobs_and_entropy,
)
from trainers.lora import activation_bytes, lora_model, memory_budget, release_openmp_workers
from trainers.losses import (
    clip_fraction,
    clipped_policy_loss,
    k3_kl_of_scored,
    kl_to_base,
    nll_loss,
    spread_positions,
)
from trainers.topk import TeacherTopK, TopKSettings, set_ids, teacher_topk, topk_loss

logger = logging.getLogger(__name__)


class Learner:
    """LoRA training of a base model, publishing adapter versions.

    Args:
        model_name: the base model, as `agents.models.resolve` takes it.
        config: the trainer config.
        run_dir: adapters go to run_dir/adapters/v<N>, checkpoints to run_dir/checkpoints.
    """

    def __init__(
        self,
        model_name: str,
        config: TrainerConfig,
        run_dir: Path,
        topk: TopKSettings | None = None,
    ):
        self.config, self.run_dir, self.topk = config, Path(run_dir), topk
        """`topk`: the top-k distillation term of hinted samples (`trainers.topk`)."""
        self.model, self.device = lora_model(model_name, config)
        self.pixels = Pixels(models.resolve(model_name)) if models.is_vision(model_name) else None
        """A vision-language model's image processor, its outputs cached per image."""
        self.checkpointing = checkpointing_mode(config.gradient_checkpointing)
        self.memory_budget = memory_budget(config, self.device)
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
        self._scorer = PrefixScorer(self.device)
        """`logprobs`' prefix reuse."""
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
        rate (an SFT warm start's own); None: `trainer.lr`. It leaves no OpenMP workers
        behind (`trainers.lora.release_openmp_workers`: idle, they slow the engine beside it)."""
        if objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {objective!r}; use one of {OBJECTIVES}")
        try:
            return self._step(samples, objective, lr)
        finally:
            release_openmp_workers()

    def _step(self, samples: list[TrainSample], objective: str, lr: float | None) -> StepMetrics:
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
        self._scorer.forget()
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
            distill_tokens=int(sums["distill_tokens"]),
        )

    def accumulate_gradients(
        self, samples: list[TrainSample], objective: str = "policy"
    ) -> dict[str, float]:
        """Backward passes over micro-batches of `samples`, gradients summed in place;
        returns the step's sums (`kl_start`, the k3 sum over tokens / total, only where the
        policy objective has RL's starting weights to score against)."""
        batches = self._micro_batches(samples)
        total = sum(len(s.completion_ids) for s in samples)
        names = ("loss", "kl", "entropy", "clip", "gap", "gap_max", "gap_tokens", "distill_tokens")
        sums: dict[str, float] = dict.fromkeys(names, 0.0) | {"batches": len(batches)}
        if objective == "nll":
            for batch in batches:
                self._fit_checkpointing(batch)
                rows, entropies = self._logprobs_and_entropy(batch)
                logprobs = pad_rows(rows)
                mask = pad_rows([torch.ones(len(s.completion_ids)) for s in batch]).to(
                    logprobs.device
                )
                loss = nll_loss(logprobs, mask, total)
                loss.backward()
                sums["loss"] += loss.item()
                sums["entropy"] += float(sum(e.sum() for e in entropies))
            return sums
        base = self._base_logprobs(batches) if self.config.kl_weight else None
        start, start_tokens = None, 0
        if self.start_weights is not None:
            start, start_tokens = self._start_logprobs(batches, self.start_weights)
            sums["kl_start"] = 0.0
        for index, batch in enumerate(batches):
            self._accumulate(
                batch,
                None if base is None else base[index],
                None if start is None else start[index],
                total,
                sums,
            )
        if start is not None:  # a mean over the tokens of the turns it read
            sums["kl_start"] *= total / max(start_tokens, 1)
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
        teachers, sets = self._teachers(batch)
        sums["distill_tokens"] += sum(
            len(s.completion_ids) for s, t in zip(batch, teachers, strict=True) if t is not None
        )
        logprobs, entropies, at_sets = self._logprobs_at(batch, True, sets)
        proximal = [row.detach() for row in logprobs]  # no update yet in this step
        current, prox = pad_rows(logprobs), pad_rows(proximal)
        device = current.device
        rollout = pad_rows([torch.tensor(s.rollout_logprobs) for s in batch]).to(device)
        advantages = pad_rows([torch.tensor(s.advantages) for s in batch]).to(device)
        mask = pad_rows([torch.ones(len(s.completion_ids)) for s in batch]).to(device)
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
            kl = kl_to_base(current, pad_rows(base), mask, total)
            loss = loss + self.config.kl_weight * kl
            sums["kl"] += kl.item()
        if (
            self.topk
            and (term := topk_loss(batch, at_sets, teachers, self.topk, total)) is not None
        ):
            loss = loss + term
        loss.backward()
        sums["loss"] += loss.item()
        if start is not None:
            sums["kl_start"] += k3_kl_of_scored(prox, start, mask, total)
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

    def logprobs(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        images: Sequence[bytes] = (),
    ) -> list[float]:
        """Log-prob of each completion token after the prompt under the current adapter;
        a vision-language prompt with its decoded `images`, in a pass of its own. Calls one
        after another (a demonstration's turns) reuse the prefix they share
        (`trainers.logprobs.PrefixScorer`). Like `step`, it leaves no OpenMP workers behind."""
        try:
            return self._completion_logprobs(prompt_ids, completion_ids, images)
        finally:
            release_openmp_workers()

    def _completion_logprobs(
        self, prompt_ids: Sequence[int], completion_ids: Sequence[int], images: Sequence[bytes]
    ) -> list[float]:
        if not images:
            causal_lm = self.model.get_base_model()
            return self._scorer(causal_lm, self.version, prompt_ids, completion_ids)
        zeros = (0.0,) * len(completion_ids)
        sample = TrainSample(0, tuple(prompt_ids), tuple(completion_ids), zeros, zeros, 0)
        with torch.no_grad():
            scored = self._logprobs([dataclasses.replace(sample, images=tuple(images))])
        return [float(x) for x in scored[0].cpu()]

    def _logprobs(self, batch: list[TrainSample]) -> list[torch.Tensor]:
        return self._logprobs_and_entropy(batch, with_entropy=False)[0]

    def _teachers(
        self, batch: list[TrainSample]
    ) -> tuple[list[TeacherTopK | None], list[torch.Tensor | None]]:
        """The hinted teacher's top-k of each sample with the top-k term (`trainers.topk`:
        the base model, adapter off, no gradient), and the ids of its sets S_t."""
        if self.topk is None:
            return [None] * len(batch), [None] * len(batch)
        with torch.no_grad(), self.model.disable_adapter():
            causal_lm = self.model.get_base_model()
            teachers = teacher_topk(causal_lm, batch, self.topk.k, self.config.logprob_chunk)
        subset = self.topk.subset
        return teachers, [set_ids(s, t, subset) for s, t in zip(batch, teachers, strict=True)]

    def _logprobs_and_entropy(
        self, batch: list[TrainSample], with_entropy: bool = True
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per sample of `batch`, its completion's log-probs (and entropies)."""
        logprobs, entropies, _ = self._logprobs_at(batch, with_entropy)
        return logprobs, entropies

    def _logprobs_at(
        self,
        batch: list[TrainSample],
        with_entropy: bool,
        extra_ids: list[torch.Tensor | None] | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor | None]]:
        """`_logprobs_and_entropy`, and each sample's log-probs at its `extra_ids`."""
        extra_ids = extra_ids or [None] * len(batch)
        if self.pixels is not None:  # a vision-language model: a pass per sample
            if any(ids is not None for ids in extra_ids):
                raise ValueError("the top-k methods do not take a vision-language model yet")
            logprobs, entropies = vision_logprobs_and_entropy(
                self.model.get_base_model(),
                self.pixels,
                batch,
                self.config.logprob_chunk,
                with_entropy,
            )
            return logprobs, entropies, list(extra_ids)
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
        logprobs, entropies, extras = span_logprobs_at(
            self.model.get_base_model(),
            sequences,
            spans,
            self.config.logprob_chunk,
            with_entropy,
            self._share_prefix,
            [extra_ids[owner] for owner in owners],
        )
        order = sorted(range(len(owners)), key=owners.__getitem__)
        return (
            [logprobs[i] for i in order],
            [entropies[i] for i in order],
            [extras[i] for i in order],
        )

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
        text = self.model.get_base_model().config.get_text_config()  # a VL model: its LM
        needed = activation_bytes(positions, text, dtype_bytes)
        self._checkpoint(needed > self.memory_budget)

    def _trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]

    def _base_logprobs(self, batches: list[list[TrainSample]]) -> list[list[torch.Tensor]]:
        """Log-probs under the base model (the adapter off), for the KL term."""
        with torch.no_grad(), self.model.disable_adapter():
            return [self._logprobs(b) for b in batches]

    def _start_logprobs(
        self, batches: list[list[TrainSample]], weights: dict[str, torch.Tensor]
    ) -> tuple[list[list[torch.Tensor | None]], int]:
        """Log-probs under the LoRA `weights` (RL's start) of the `kl_estimate_turns` turns
        the estimate reads (None for the others), and their completion tokens; the weights
        are swapped in for one no-grad pass and back: the tensors trade places, nothing is
        copied."""
        count = sum(len(batch) for batch in batches)
        read = set(spread_positions(count, self.config.kl_estimate_turns))
        params = self._trainable()
        current = [p.data for _, p in params]
        scored: list[list[torch.Tensor | None]] = []
        tokens = position = 0
        try:
            with torch.no_grad():
                for name, p in params:
                    p.data = weights[name]
                for batch in batches:
                    picked = [i for i in range(len(batch)) if position + i in read]
                    rows = iter(self._logprobs([batch[i] for i in picked]) if picked else [])
                    scored.append([next(rows) if i in picked else None for i in range(len(batch))])
                    tokens += sum(len(batch[i].completion_ids) for i in picked)
                    position += len(batch)
        finally:
            for (_, p), data in zip(params, current, strict=True):
                p.data = data
        return scored, tokens

    # -- publishing and checkpoints ------------------------------------------------------
    def start_from(self, adapter: str | Path) -> Path:
        """Starts a fresh run from a trained LoRA adapter (`trainer.init_adapter`): its
        weights become the policy, served as version 1 (version 0 stays the base model, so
        that turns sampled with the adapter are told apart); returns adapters/v1.

        Raises:
            ValueError: no adapter there, or one shaped unlike this learner's LoRA.
        """
        path = load_adapter(self.model, adapter)
        self.version = 1
        self._scorer.forget()
        logger.info("starting from the adapter at %s (served as version 1)", path)
        return self.save_adapter()

    def save_adapter(self, name: str | None = None) -> Path:
        """Writes the current adapter as run_dir/adapters/v<version> (or run_dir/<name>);
        returns the directory."""
        target = self.run_dir / name if name else self.run_dir / "adapters" / f"v{self.version}"
        return save_adapter_dir(self.model, target)

    def save_checkpoint(self, cursor: dict[str, Any]) -> Path:
        """Adapter, optimiser, step, version, RNG states, RL's starting weights and the
        caller's cursor, atomically: a crash mid-write leaves the previous checkpoint intact."""
        state = {
            "step": self.step_count,
            "version": self.version,
            "trained_seqs": list(self.trained_seqs),
            "ledger": self.ledger,
            "cursor": cursor,
        }
        return save_lora_checkpoint(
            self.run_dir, self.model, self.optimizer, self.start_weights, state
        )

    def load_checkpoint(self) -> dict[str, Any] | None:
        """Restores the newest complete checkpoint; returns its state (None if there is none)."""
        from safetensors.torch import load_file

        found = newest_checkpoint(self.run_dir)
        if found is None:
            return None
        state = load_lora_checkpoint(found, self.model, self.optimizer)
        self.step_count, self.version = state["step"], state["version"]
        self._scorer.forget()
        self.trained_seqs = tuple(state["trained_seqs"])
        self.ledger = [list(seqs) for seqs in state["ledger"]]
        start = found / START_WEIGHTS
        if self.config.kl_estimate and start.exists():
            self.start_weights = load_file(start, device=str(self.device))
        logger.info(
            "resumed from %s at step %d (adapter v%d)", found, self.step_count, self.version
        )
        return state
