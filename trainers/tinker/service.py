"""The Tinker server's compute: LoRA training clients on clawgym's `Learner`, Tinker's losses,
checkpoints under a run directory, and sampling sessions on them.

Every method runs on the server's one worker thread, so the models never see two calls at
once. Tinker's losses are sums over tokens (not means), so the gradients of the chunks the
SDK splits a forward_backward into add up to the gradient of the whole call.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agents import models
from trainers.config import TrainerConfig
from trainers.learner import Learner
from trainers.tinker import checkpoints
from trainers.tinker.errors import UserError
from trainers.tinker.samplers import Sampler, TorchSampler
from trainers.tinker.sampling import SamplingParams, batch_target_logprobs
from trainers.tinker.wire import Datum, Sampled

logger = logging.getLogger(__name__)

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
"""The loss_fn values served (the SDK's forward_backward_custom runs on the client, over
`forward` and a linearised cross_entropy, so it needs nothing more here)."""

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

_POLICY_GRADIENT_INPUTS = ("target_tokens", "logprobs", "advantages")
_LOSS_INPUTS = {"cross_entropy": ("target_tokens",)} | {
    name: _POLICY_GRADIENT_INPUTS for name in LOSSES if name != "cross_entropy"
}
_CLIPS = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0)}
"""Each clipped loss's default (clip_low_threshold, clip_high_threshold), as Tinker's."""
DRO_BETA = 0.05
"""Tinker's default weight of DRO's quadratic penalty."""


def tinker_loss(
    loss_fn: str, logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict
) -> torch.Tensor:
    """Per-token loss of one datum (summed by the caller), as Tinker defines it, with
    ratio = exp(logp - sampling logp) and A the advantage.

    cross_entropy: -weights * logp. importance_sampling: -ratio * A. ppo: the clipped
    surrogate -min(ratio * A, clip(ratio) * A). cispo: -sg(clip(ratio)) * logp * A, the
    clipped ratio a constant coefficient. dro: -(logp * A - beta / 2 * (logp - sampling
    logp)^2). The clip range is [clip_low_threshold, clip_high_threshold] (ppo 0.8-1.2,
    cispo 0-4 by default), beta 0.05 by default.
    """
    if loss_fn == "cross_entropy":
        return -inputs.get("weights", torch.ones_like(logprobs)) * logprobs
    advantages, sampled = inputs["advantages"], inputs["logprobs"]
    if loss_fn == "dro":
        beta = float(config.get("beta", DRO_BETA))
        return -(logprobs * advantages - 0.5 * beta * (logprobs - sampled) ** 2)
    ratio = torch.exp(logprobs - sampled)
    if loss_fn == "importance_sampling":
        return -ratio * advantages
    default_low, default_high = _CLIPS[loss_fn]
    clipped = ratio.clamp(
        float(config.get("clip_low_threshold", default_low)),
        float(config.get("clip_high_threshold", default_high)),
    )
    if loss_fn == "cispo":
        return -clipped.detach() * logprobs * advantages
    return -torch.minimum(ratio * advantages, clipped * advantages)


class TinkerService:
    """The service behind clawgym's Tinker API (`trainers.tinker.app`): training clients
    and samplers on one base model.

    Args:
        model_name: the base model served, as `agents.models.resolve` takes it.
        run_dir: each training client's adapters and checkpoints go to run_dir/<model id>.
        sampler: who samples (default: `TorchSampler`, in this process).
        device, dtype: where the training clients' learners train and in what (as
            `trainer.device` and `trainer.dtype` take them: auto is a GPU when there is one).
    """

    def __init__(
        self,
        model_name: str,
        run_dir: Path,
        sampler: Sampler | None = None,
        device: str = "cpu",
        dtype: str = "auto",
    ):
        self.model_name, self.run_dir = model_name, Path(run_dir)
        self.device, self.dtype = device, dtype
        self.sampler: Sampler = sampler or TorchSampler(model_name)
        self.learners: dict[str, Learner] = {}
        self.samplers: dict[str, str | None] = {}
        """Sampling session id -> the tinker:// path it samples (None: the base model)."""
        config = json.loads((models.resolve(model_name) / "config.json").read_text())
        self.vocab_size = int(config["vocab_size"])

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

    def create_model(
        self,
        model_id: str,
        base_model: str,
        rank: int,
        seed: int | None = None,
        attn: bool = True,
        mlp: bool = True,
    ) -> None:
        """A LoRA of `rank` on the attention and / or MLP projections (Tinker's train_attn,
        train_mlp; train_unembed is not served: the unembedding never gets an adapter)."""
        self.check_model(base_model)
        if rank < 1:
            raise UserError(f"LoRA rank must be at least 1, got {rank}")
        targets = [*(ATTENTION if attn else ()), *(MLP if mlp else ())]
        if not targets:
            raise UserError("train_attn and train_mlp are both false: nothing to train")
        if seed is not None:
            torch.manual_seed(seed)
        config = TrainerConfig(
            lora_rank=rank,
            target_modules=targets,
            gradient_checkpointing="false",
            device=self.device,
            dtype=self.dtype,
        )
        self.learners[model_id] = Learner(
            self.model_name, config, self.run_dir / checkpoints.model_slug(model_id)
        )
        checkpoints.write_run_record(self.run_dir, model_id, self.model_name, rank, attn, mlp)

    def learner(self, model_id: str) -> Learner:
        if model_id not in self.learners:
            raise UserError(f"unknown model_id {model_id!r}")
        return self.learners[model_id]

    def forward_backward(
        self, model_id: str, loss_fn: str, config: dict, data: tuple[Datum, ...], forward_only: bool
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Gradients of the summed loss accumulate (until optim_step); returns each datum's
        target log-probs and per-token loss, and the metric loss:sum."""
        learner = self.learner(model_id)
        if loss_fn not in LOSSES:
            raise UserError(f"unknown loss_fn {loss_fn!r}; this server serves {LOSSES}")
        _check_loss_config(loss_fn, config)
        checked = [_check_datum(d, i, loss_fn, _vocab(learner.model)) for i, d in enumerate(data)]
        outputs, total = [], 0.0
        on = learner.device
        with torch.set_grad_enabled(not forward_only):
            for batch in _micro_batches(checked, learner.config.micro_batch_tokens):
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
        """One Adam step on the accumulated gradients, with this call's hyperparameters."""
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

    def save(self, model_id: str, kind: str, name: str) -> str:
        """save_state (`weights`) or save_weights_for_sampler (`sampler_weights`); returns the
        checkpoint's tinker:// path."""
        directory = checkpoints.save_state(self.learner(model_id), kind, name)
        self.sampler.forget(directory)
        return checkpoints.tinker_path(model_id, kind, name)

    def load(self, model_id: str, path: str, optimizer: bool) -> None:
        """load_state into an existing model, or a new model created from the checkpoint."""
        found = checkpoints.directory(self.run_dir, path)
        if model_id not in self.learners:
            rank, targets = checkpoints.adapter_shape(found)
            attn, mlp = bool(targets & set(ATTENTION)), bool(targets & set(MLP))
            self.create_model(model_id, self.model_name, rank, None, attn, mlp)
        checkpoints.load_state(self.learners[model_id], found, optimizer)

    def delete_checkpoint(self, model_id: str, checkpoint_id: str) -> None:
        """Removes a saved checkpoint (`weights/NAME` or `sampler_weights/NAME`)."""
        self.sampler.forget(checkpoints.delete(self.run_dir, model_id, checkpoint_id))

    def open_sampler(self, model_path: str | None, base_model: str | None) -> str:
        """A sampling session on a checkpoint (or, with no path, the base model)."""
        if model_path is None:
            self.check_model(base_model)
        else:
            checkpoints.directory(self.run_dir, model_path)
        sampler_id = f"sampler-{len(self.samplers)}"
        self.samplers[sampler_id] = model_path
        return sampler_id

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
        if sampler_id not in self.samplers:
            raise UserError(f"unknown sampling session {sampler_id!r}")
        if not prompt or max(prompt) >= self.vocab_size or min(prompt) < 0:
            raise UserError("the prompt must be a non-empty list of token ids in the vocabulary")
        path = self.samplers[sampler_id]
        adapter = checkpoints.directory(self.run_dir, path) if path else None
        return self.sampler.sample(adapter, prompt, num_samples, params, prompt_logprobs)

    def close(self) -> None:
        self.sampler.close()


def _micro_batches(rows: list[_Checked], budget: int) -> list[list[_Checked]]:
    """Consecutive groups whose padded size (rows x longest) stays within the budget."""
    batches: list[list[_Checked]] = [[]]
    for row in rows:
        longest = max(len(t) for t, _ in [*batches[-1], row])
        if batches[-1] and longest * (len(batches[-1]) + 1) > budget:
            batches.append([])
        batches[-1].append(row)
    return batches if batches[-1] else []


def _vocab(model: Any) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


_Checked = tuple[torch.Tensor, dict[str, torch.Tensor]]
"""A datum's tokens and loss inputs, checked."""


_LOSS_CONFIG = {"ppo": ("clip_low_threshold", "clip_high_threshold"), "dro": ("beta",)}
_LOSS_CONFIG["cispo"] = _LOSS_CONFIG["ppo"]


def _check_loss_config(loss_fn: str, config: dict | None) -> None:
    """Only the loss's own settings, each a number: a typo must not train on a default."""
    allowed = _LOSS_CONFIG.get(loss_fn, ())
    for name, value in (config or {}).items():
        if name not in allowed:
            raise UserError(
                f"{loss_fn} takes no loss_fn_config {name!r}"
                + (f"; it takes {list(allowed)}" if allowed else "")
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"loss_fn_config {name!r} must be a number, got {value!r}")


def _check_datum(datum: Datum, index: int, loss_fn: str, vocab: int) -> _Checked:
    """The datum's tokens and loss inputs as tensors, after checking names and shapes."""
    length = len(datum.tokens)
    if length == 0:
        raise UserError(f"datum {index}: empty model_input")
    missing = [n for n in _LOSS_INPUTS[loss_fn] if n not in datum.inputs]
    if missing:
        raise UserError(f"datum {index}: {loss_fn} needs loss_fn_inputs {missing}")
    inputs = {}
    for name, array in datum.inputs.items():
        if array.shape != (length,):
            raise UserError(
                f"datum {index}: {name} has shape {list(array.shape)}, "
                f"model_input has {length} tokens"
            )
        inputs[name] = torch.from_numpy(array.copy())
    targets = inputs["target_tokens"] = inputs["target_tokens"].long()
    tokens = torch.tensor(datum.tokens)
    if int(max(tokens.max(), targets.max())) >= vocab or int(min(tokens.min(), targets.min())) < 0:
        raise UserError(f"datum {index}: token ids outside the vocabulary of {vocab}")
    return tokens, {n: t if n == "target_tokens" else t.float() for n, t in inputs.items()}
