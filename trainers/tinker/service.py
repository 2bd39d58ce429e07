"""The Tinker server's compute: LoRA training clients on clawgym's `Learner`, Tinker's losses
(`trainers.tinker.losses`), checkpoints under a run directory, and sampling sessions on them,
each held for the owner (API key) that made it.

The compute methods run on the server's one worker thread, so the models never see two calls
at once; the bookkeeping of sessions, owners and samplers is behind a lock, since the routes
read it on the event loop. Tinker's losses are sums over tokens (not means), so the gradients
of the chunks the SDK splits a forward_backward into add up to the gradient of the whole call.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import secrets
import shutil
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agents import models
from trainers.config import TrainerConfig
from trainers.learner import Learner
from trainers.lora import release_openmp_workers
from trainers.tinker import checkpoints, quota
from trainers.tinker.checkpoints import LOCAL
from trainers.tinker.errors import NotFound, TooMany, UserError
from trainers.tinker.limits import TinkerLimits
from trainers.tinker.losses import (
    ATTENTION,
    LOSSES,
    MLP,
    check_datum,
    check_loss_config,
    micro_batches,
    tinker_loss,
    vocab_size,
)
from trainers.tinker.samplers import Sampler, TorchSampler
from trainers.tinker.sampling import SamplingParams, batch_target_logprobs
from trainers.tinker.wire import Datum, Sampled

__all__ = ["TinkerService"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplerSession:
    """A sampling session: whose, opened in which SDK session, on what."""

    owner: str
    session: str | None
    path: str | None
    """The tinker:// checkpoint it samples (None: the base model, or a snapshot)."""
    snapshot: Path | None = None
    """The unnamed snapshot of a training client's weights it samples, removed with it."""


class TinkerService:
    """The service behind clawgym's Tinker API (`trainers.tinker.app`): sessions, training
    clients and samplers on one base model, each visible only to its owner.

    Args:
        model_name: the base model served, as `agents.models.resolve` takes it.
        run_dir: each training client's adapters and checkpoints go to run_dir/<model id>.
        sampler: who samples (default: `TorchSampler`, in this process).
        device, dtype: where the training clients' learners train and in what (as
            `trainer.device` and `trainer.dtype` take them: auto is a GPU when there is one).
        limits: what clients may ask for (`TinkerLimits`' defaults when None).
    """

    def __init__(
        self,
        model_name: str,
        run_dir: Path,
        sampler: Sampler | None = None,
        device: str = "cpu",
        dtype: str = "auto",
        limits: TinkerLimits | None = None,
    ):
        self.model_name, self.run_dir = model_name, Path(run_dir)
        self.device, self.dtype = device, dtype
        self.limits = limits or TinkerLimits()
        self.sampler: Sampler = sampler or TorchSampler(model_name, self.limits.max_sampler_copies)
        self.learners: dict[str, Learner] = {}
        self.owners: dict[str, str] = {}
        """Live training client -> its owner."""
        self.sessions: dict[str, str] = {}
        """SDK session id -> its owner."""
        self.samplers: OrderedDict[str, SamplerSession] = OrderedDict()
        """Sampling session id -> what it samples, least recently used first."""
        self._lock = threading.RLock()
        config = json.loads((models.resolve(model_name) / "config.json").read_text())
        self.vocab_size = int(config["vocab_size"])
        context = int(config.get("max_position_embeddings") or self.limits.max_seq_len)
        self.context = min(self.limits.max_seq_len, context)
        """The longest datum, or prompt plus max_tokens, served."""

    def capabilities(self) -> list[dict[str, Any]]:
        return [{"model_name": self.model_name, "trainable": True, "sampleable": True}]

    def tokenizer_id(self) -> str:
        """Where the SDK's get_tokenizer loads the tokenizer from: the local model directory."""
        return str(models.resolve(self.model_name))

    def check_model(self, base_model: str | None) -> None:
        """The served model, by its name or by its local directory (the tokenizer id), since
        clients such as tinker-cookbook use one string as both base model and tokenizer."""
        if base_model not in (self.model_name, self.tokenizer_id()):
            raise UserError(
                f"unknown base model {base_model!r}; this server serves {self.model_name!r}"
            )

    def open_session(self, owner: str) -> str:
        """A new SDK session of `owner`'s; its id is random, so never one of another run's."""
        session_id = f"session-{secrets.token_hex(16)}"
        with self._lock:
            self.sessions[session_id] = owner
        return session_id

    def check_session(self, owner: str, session_id: Any) -> str:
        """Raises NotFound unless `session_id` is a live session of `owner`'s."""
        with self._lock:
            if not isinstance(session_id, str) or self.sessions.get(session_id) != owner:
                raise NotFound(f"unknown session {session_id!r}")
        return session_id

    def finish_session(self, owner: str, session_id: str) -> None:
        """Frees what the session holds: its training clients' learners and its samplers
        (their checkpoints stay on disk)."""
        self.check_session(owner, session_id)
        with self._lock:
            del self.sessions[session_id]
            models_held = [m for m in self.owners if m.startswith(f"{session_id}:")]
            samplers = [s for s, r in self.samplers.items() if r.session == session_id]
        for model_id in models_held:
            self.unload(model_id)
        for sampler_id in samplers:
            self.close_sampler(sampler_id)

    def model_id(self, owner: str, session_id: Any, seq_id: Any) -> str:
        """The id of the session's `seq_id`th training client (as the SDK derives it)."""
        self.check_session(owner, session_id)
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or not 0 <= seq_id < 10**9:
            raise UserError(f"model_seq_id must be an integer from 0 to 10^9, got {seq_id!r}")
        return f"{session_id}:train:{seq_id}"

    def check_owner(self, owner: str, model_id: Any) -> str:
        """Raises NotFound unless `model_id` is a live training client of `owner`'s."""
        with self._lock:
            if not isinstance(model_id, str) or self.owners.get(model_id) != owner:
                raise NotFound(f"unknown model_id {model_id!r}")
        return model_id

    def check_capacity(self, owner: str) -> None:
        """Raises TooMany when `owner` holds `max_training_clients` training clients."""
        with self._lock:
            held = sum(1 for o in self.owners.values() if o == owner)
        if held >= self.limits.max_training_clients:
            raise TooMany(
                f"this key holds {held} training clients, the limit "
                f"(tinker.limits.max_training_clients): finish a session or unload one"
            )

    def check_rank(self, rank: int) -> None:
        if not 1 <= rank <= self.limits.max_lora_rank:
            raise UserError(
                f"LoRA rank must be from 1 to {self.limits.max_lora_rank} "
                f"(tinker.limits.max_lora_rank), got {rank}"
            )

    def create_model(
        self,
        model_id: str,
        base_model: str,
        rank: int,
        seed: int | None = None,
        attn: bool = True,
        mlp: bool = True,
        owner: str = LOCAL,
    ) -> None:
        """A LoRA of `rank` on the attention and / or MLP projections (Tinker's train_attn,
        train_mlp; train_unembed is not served: the unembedding never gets an adapter)."""
        self.check_model(base_model)
        self.check_rank(rank)
        targets = [*(ATTENTION if attn else ()), *(MLP if mlp else ())]
        if not targets:
            raise UserError("train_attn and train_mlp are both false: nothing to train")
        slug = checkpoints.model_slug(model_id)
        if model_id in self.learners or checkpoints.run_owner(self.run_dir, model_id):
            raise UserError(f"model_id {model_id!r} exists: use the next model_seq_id")
        self.check_capacity(owner)
        if seed is not None:
            torch.manual_seed(seed)
        config = TrainerConfig(
            lora_rank=rank,
            target_modules=targets,
            gradient_checkpointing="false",
            device=self.device,
            dtype=self.dtype,
        )
        learner = Learner(self.model_name, config, self.run_dir / slug)
        checkpoints.write_run_record(
            self.run_dir, model_id, self.model_name, rank, attn, mlp, owner
        )
        with self._lock:
            self.learners[model_id], self.owners[model_id] = learner, owner

    def unload(self, model_id: str) -> None:
        """Frees a training client's learner (its run and checkpoints stay on disk)."""
        with self._lock:
            learner = self.learners.pop(model_id, None)
            self.owners.pop(model_id, None)
        if learner is not None:
            del learner
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def learner(self, model_id: str) -> Learner:
        if model_id not in self.learners:
            raise NotFound(f"unknown model_id {model_id!r}")
        return self.learners[model_id]

    def check_data(self, data: tuple[Datum, ...]) -> None:
        """Raises UserError for a datum longer than the served context."""
        for index, datum in enumerate(data):
            if len(datum.tokens) > self.context:
                raise UserError(
                    f"datum {index} has {len(datum.tokens)} tokens, over the {self.context} "
                    "served (the model's context, or tinker.limits.max_seq_len)"
                )

    def forward_backward(
        self, model_id: str, loss_fn: str, config: dict, data: tuple[Datum, ...], forward_only: bool
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Gradients of the summed loss accumulate (until optim_step); returns each datum's
        target log-probs and per-token loss, and the metric loss:sum.

        It runs on a long-lived worker thread beside the sampler's engine, so the thread's
        OpenMP workers are let go after it (`release_openmp_workers`: idle, they slowed the
        engine's decoding by a third in the main job)."""
        try:
            return self._forward_backward(model_id, loss_fn, config, data, forward_only)
        finally:
            release_openmp_workers()

    def _forward_backward(
        self, model_id: str, loss_fn: str, config: dict, data: tuple[Datum, ...], forward_only: bool
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        learner = self.learner(model_id)
        if loss_fn not in LOSSES:
            raise UserError(f"unknown loss_fn {loss_fn!r}; this server serves {LOSSES}")
        check_loss_config(loss_fn, config)
        self.check_data(data)
        vocab = vocab_size(learner.model)
        checked = [check_datum(d, i, loss_fn, vocab) for i, d in enumerate(data)]
        outputs, total = [], 0.0
        on = learner.device
        with torch.set_grad_enabled(not forward_only):
            for batch in micro_batches(checked, learner.config.micro_batch_tokens):
                tokens = [t.to(on) for t, _ in batch]
                inputs = [{n: v.to(on) for n, v in i.items()} for _, i in batch]
                rows = batch_target_logprobs(
                    learner.model, tokens, [i["target_tokens"] for i in inputs]
                )
                losses = [
                    tinker_loss(loss_fn, lp, row_inputs, config)
                    for lp, row_inputs in zip(rows, inputs, strict=True)
                ]
                if not forward_only:
                    torch.stack([loss.sum() for loss in losses]).sum().backward()
                total += sum(float(loss.detach().sum()) for loss in losses)
                outputs += [
                    {
                        "logprobs": lp.detach().float().cpu().numpy(),
                        "elementwise_loss": loss.detach().float().cpu().numpy(),
                    }
                    for lp, loss in zip(rows, losses, strict=True)
                ]
        return outputs, {"loss:sum": total}

    def optim_step(self, model_id: str, adam: dict[str, float]) -> dict[str, float]:
        """One Adam step on the accumulated gradients, with this call's hyperparameters (its
        thread's OpenMP workers let go after it, as `forward_backward`'s)."""
        try:
            return self._optim_step(model_id, adam)
        finally:
            release_openmp_workers()

    def _optim_step(self, model_id: str, adam: dict[str, float]) -> dict[str, float]:
        learner = self.learner(model_id)
        params = [p for p in learner.model.parameters() if p.requires_grad]
        for group in learner.optimizer.param_groups:
            group["lr"] = float(adam.get("learning_rate", 1e-4))
            group["betas"] = (float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95)))
            group["eps"] = float(adam.get("eps", 1e-12))
            group["weight_decay"] = float(adam.get("weight_decay", 0.0))
        clip = float(adam.get("grad_clip_norm", 0.0))
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf)
        learner.optimizer.step()
        learner.optimizer.zero_grad(set_to_none=True)
        learner.step_count += 1
        learner.version += 1
        return {"grad_norm:mean": float(norm)}

    def check_room(self, owner: str, model_id: str, kind: str, name: str) -> None:
        """Raises QuotaExceeded where `owner` may save no more checkpoints (`quota`)."""
        target = self.run_dir / checkpoints.model_slug(model_id) / kind / name
        quota.check_room(self.run_dir, owner, self.limits, target)

    def save(self, model_id: str, kind: str, name: str) -> str:
        """save_state (`weights`) or save_weights_for_sampler (`sampler_weights`), within
        the owner's checkpoint quota; returns the checkpoint's tinker:// path."""
        learner, owner = self.learner(model_id), self.owners[model_id]

        def admit(target: Path, size: int) -> None:
            quota.check_room(self.run_dir, owner, self.limits, target, size)

        directory = checkpoints.save_state(learner, kind, name, admit)
        self.sampler.forget(directory)
        return checkpoints.tinker_path(model_id, kind, name)

    def load(self, model_id: str, path: str, optimizer: bool, owner: str = LOCAL) -> None:
        """load_state into an existing model, or a new model created from the checkpoint."""
        found = checkpoints.directory(self.run_dir, path, owner)
        if model_id not in self.learners:
            rank, targets = checkpoints.adapter_shape(found)
            attn, mlp = bool(targets & set(ATTENTION)), bool(targets & set(MLP))
            self.create_model(model_id, self.model_name, rank, None, attn, mlp, owner)
        checkpoints.load_state(self.learners[model_id], found, optimizer)

    def delete_checkpoint(self, model_id: str, checkpoint_id: str, owner: str = LOCAL) -> None:
        """Removes a saved checkpoint (`weights/NAME` or `sampler_weights/NAME`)."""
        found = checkpoints.delete(self.run_dir, model_id, checkpoint_id, owner)
        self.sampler.forget(found)

    def open_sampler(
        self,
        model_path: str | None,
        base_model: str | None,
        owner: str = LOCAL,
        session: str | None = None,
    ) -> str:
        """A sampling session on one of `owner`'s checkpoints (or, with no path, the base
        model)."""
        if model_path is None:
            self.check_model(base_model)
        else:
            checkpoints.directory(self.run_dir, model_path, owner)
        return self._add_sampler(SamplerSession(owner, session, model_path))

    def snapshot_sampler(self, model_id: str) -> str:
        """A sampling session on a snapshot of the training client's weights now (the
        SDK's save_weights_for_sampler without a name), removed when the session closes."""
        snapshot = checkpoints.save_state(self.learner(model_id), "sampler_weights", None)
        owner, session = self.owners[model_id], model_id.split(":")[0]
        return self._add_sampler(SamplerSession(owner, session, None, snapshot))

    def _add_sampler(self, record: SamplerSession) -> str:
        """Registers it; past `max_samplers` of the owner's, the least recently used closes."""
        sampler_id = f"sampler-{secrets.token_urlsafe(16)}"
        with self._lock:
            self.samplers[sampler_id] = record
            mine = [s for s, r in self.samplers.items() if r.owner == record.owner]
        for old in mine[: max(0, len(mine) - self.limits.max_samplers)]:
            self.close_sampler(old)
        return sampler_id

    def sampler_session(self, owner: str, sampler_id: Any) -> SamplerSession:
        """`owner`'s sampling session, now the most recently used.

        Raises:
            NotFound: no such session of `owner`'s (closed, or never opened).
        """
        with self._lock:
            record = self.samplers.get(sampler_id) if isinstance(sampler_id, str) else None
            if record is None or record.owner != owner:
                raise NotFound(f"unknown sampling session {sampler_id!r}")
            self.samplers.move_to_end(sampler_id)
        return record

    def close_sampler(self, sampler_id: str) -> None:
        with self._lock:
            record = self.samplers.pop(sampler_id, None)
        if record is not None and record.snapshot is not None:
            self.sampler.forget(record.snapshot)
            shutil.rmtree(record.snapshot, ignore_errors=True)

    def check_sample(self, prompt: list[int], num_samples: int, params: SamplingParams) -> None:
        """Raises UserError for a call past the limits or the vocabulary."""
        limits = self.limits
        if not 1 <= num_samples <= limits.max_num_samples:
            raise UserError(
                f"num_samples must be from 1 to {limits.max_num_samples} "
                f"(tinker.limits.max_num_samples), got {num_samples}"
            )
        if params.max_tokens > limits.max_tokens:
            raise UserError(
                f"max_tokens {params.max_tokens} is over {limits.max_tokens} "
                "(tinker.limits.max_tokens)"
            )
        if len(prompt) + params.max_tokens > self.context:
            raise UserError(
                f"the prompt's {len(prompt)} tokens and max_tokens {params.max_tokens} are "
                f"over the {self.context} served (the model's context, or max_seq_len)"
            )
        if not prompt or max(prompt) >= self.vocab_size or min(prompt) < 0:
            raise UserError("the prompt must be a non-empty list of token ids in the vocabulary")

    def sample(
        self,
        sampler_id: str,
        prompt: list[int],
        num_samples: int,
        params: SamplingParams,
        prompt_logprobs: bool,
    ) -> tuple[list[Sampled], list[float] | None]:
        """`num_samples` continuations of `prompt`, and the prompt's own log-probs (NaN
        first) when asked."""
        record = self.samplers.get(sampler_id)
        if record is None:
            raise NotFound(f"unknown sampling session {sampler_id!r}")
        self.check_sample(prompt, num_samples, params)
        adapter = record.snapshot
        if record.path is not None:
            adapter = checkpoints.directory(self.run_dir, record.path, record.owner)
        return self.sampler.sample(adapter, prompt, num_samples, params, prompt_logprobs)

    def close(self) -> None:
        self.sampler.close()
