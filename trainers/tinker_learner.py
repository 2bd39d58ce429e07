"""The learner of `backend=tinker`: the method's LoRA steps taken by a Tinker service.

It is a `trainers.learning.PolicyLearner`, as the local `trainers.learner.Learner` is, and
does each step through a Tinker training client: one
`forward_backward` with Tinker's `ppo` loss on the stored rollout log-probs and the method's
per-token advantages, the ratio to the rollout kept in [1 - trainer.clip_low,
1 + trainer.clip_high] (`ppo_config`), then `optim_step` (AdamW at `trainer.lr`, clipped at
`trainer.grad_clip`). The local learner's ratio is to the weights at the step's start, with
turns from older adapters weighted by the truncated importance ratio (`importance_cap`);
over Tinker, one call per step has no such forward, so a stale turn's ratio is clipped
against its own rollout instead, as in PPO proper. Tinker's losses are sums over tokens, so each
advantage is divided by the step's completion tokens: the gradient is that of the mean
over tokens, as the local learner's. Prompt positions carry advantage 0.

A published version is a `save_weights_for_sampler` checkpoint; adapters/v<N> holds only
its `tinker://` path (`agents.engines.tinker.TINKER_POINTER`), which the Tinker engine opens
a sampling client on. Checkpoints are `save_state` ones (weights and optimiser), named in
checkpoints/latest/state.json beside the step, version and ledger; a resumed run opens a
training client on that state.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from agents.engines.tinker import TINKER_POINTER
from trainers.checkpoints import commit_checkpoint, newest_checkpoint
from trainers.compute_config import BackendConfig
from trainers.config import TrainerConfig
from trainers.learning import StepMetrics, TrainSample

logger = logging.getLogger(__name__)

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
"""`trainer.target_modules` that Tinker's `train_attn` covers; the rest is `train_mlp`."""


def datum(sample: TrainSample, tokens_in_step: int) -> Any:
    """A turn as Tinker's next-token datum: inputs all but the last token, targets all but
    the first; log-probs and advantages are the rollout's on completion targets, 0 on the
    prompt's."""
    from tinker import types

    tokens = [*sample.prompt_ids, *sample.completion_ids]
    shift = len(sample.prompt_ids) - 1
    inputs: dict[str, np.ndarray] = {
        "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
        "logprobs": np.asarray([0.0] * shift + list(sample.rollout_logprobs), dtype=np.float32),
        "advantages": np.asarray(
            [0.0] * shift + [a / tokens_in_step for a in sample.advantages], dtype=np.float32
        ),
    }
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={k: types.TensorData.from_numpy(v) for k, v in inputs.items()},
    )


def ppo_config(config: TrainerConfig) -> dict[str, float]:
    """Tinker's `ppo` loss_fn_config for the trainer's clip range."""
    return {
        "clip_low_threshold": 1.0 - config.clip_low,
        "clip_high_threshold": 1.0 + config.clip_high,
    }


class TinkerLearner:
    """LoRA training on a Tinker service.

    Args:
        service: a `tinker.ServiceClient`.
        base_model: the service's name of the base model.
        config: the trainer config (rank, target modules, learning rate, grad clip).
        run_dir: adapter pointers go to run_dir/adapters/v<N>, checkpoint state to
            run_dir/checkpoints.
        seed: seeds the LoRA initialisation.
    """

    def __init__(
        self, service: Any, base_model: str, config: TrainerConfig, run_dir: Path, seed: int = 0
    ):
        self.service, self.config, self.run_dir = service, config, Path(run_dir)
        attn = any(m in ATTENTION for m in config.target_modules)
        mlp = any(m not in ATTENTION for m in config.target_modules)
        self.training = service.create_lora_training_client(
            base_model=base_model,
            rank=config.lora_rank,
            seed=seed,
            train_attn=attn,
            train_mlp=mlp,
            train_unembed=False,
        ).result()
        self.step_count = 0
        self.version = 0
        self.trained_seqs: tuple[int, ...] = ()
        self.ledger: list[list[int]] = []

    def step(
        self, samples: list[TrainSample], objective: str = "policy", lr: float | None = None
    ) -> StepMetrics:
        """One optimiser step on the service over `samples`; returns its metrics.

        Raises:
            ValueError: `objective` other than policy (supervised steps are the local
                learner's).
        """
        from tinker import types

        if objective != "policy":
            raise ValueError(f"backend=tinker takes policy steps only, not {objective!r}")
        started = time.monotonic()
        total = sum(len(s.completion_ids) for s in samples)
        data = [datum(s, max(total, 1)) for s in samples]
        clip = ppo_config(self.config)
        output = self.training.forward_backward(data, "ppo", loss_fn_config=clip).result()
        adam = types.AdamParams(  # the local learner's AdamW (torch's defaults)
            learning_rate=self.config.lr if lr is None else lr,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            grad_clip_norm=self.config.grad_clip,
        )
        optimised = self.training.optim_step(adam).result()
        self.step_count += 1
        self.version += 1
        self.trained_seqs = tuple(s.seq for s in samples)
        self.ledger.append(list(self.trained_seqs))
        drift = _drift(samples, output.loss_fn_outputs, clip, self.version - 1)
        advantages = [a for s in samples for a in s.advantages]
        return StepMetrics(
            step=self.step_count,
            version=self.version,
            turns=len(samples),
            tokens=total,
            loss=float(output.metrics.get("loss:sum", 0.0)),
            kl=0.0,
            # the service returns the sampled tokens' log-probs only: no distribution to take
            # an entropy of, and no frozen starting weights to score them under
            kl_to_start=None,
            entropy=None,
            clip_fraction=drift["clipped"] / max(drift["tokens"], 1),
            mean_advantage=sum(advantages) / max(len(advantages), 1),
            logprob_gap=drift["gap"] / max(drift["gap_tokens"], 1),
            logprob_gap_max=drift["gap_max"],
            grad_norm=float((optimised.metrics or {}).get("grad_norm:mean", 0.0)),
            seconds=round(time.monotonic() - started, 3),
        )

    def start_from(self, adapter: str | Path) -> Path:
        """Refused: a Tinker run starts from the base model (`validate` says so first).

        Raises:
            ValueError: always.
        """
        raise ValueError(f"backend=tinker starts from the base model, not {adapter}")

    def save_adapter(self, name: str | None = None) -> Path:
        """Saves the weights for sampling on the service and writes their `tinker://` path to
        run_dir/adapters/v<version> (or run_dir/<name>); returns the directory."""
        label = name or f"v{self.version}"
        saved = self.training.save_weights_for_sampler(name=label).result()
        target = self.run_dir / name if name else self.run_dir / "adapters" / label
        target.mkdir(parents=True, exist_ok=True)
        pointer = {"model_path": saved.path, "version": self.version}
        (target / TINKER_POINTER).write_text(json.dumps(pointer))
        return target

    def save_checkpoint(self, cursor: dict[str, Any]) -> Path:
        """The training state (weights and optimiser) on the service, and its path with the
        step, version, ledger and the caller's cursor here, atomically."""
        saved = self.training.save_state(name=f"step-{self.step_count}").result()
        state = {
            "step": self.step_count,
            "version": self.version,
            "trained_seqs": list(self.trained_seqs),
            "ledger": self.ledger,
            "tinker_state": saved.path,
            "cursor": cursor,
        }
        return commit_checkpoint(self.run_dir, lambda staging: state)

    def load_checkpoint(self) -> dict[str, Any] | None:
        """Opens a training client on the newest checkpoint's state (None if there is none)."""
        found = newest_checkpoint(self.run_dir)
        if found is None:
            return None
        state: dict[str, Any] = json.loads((found / "state.json").read_text())
        self.training = self.service.create_training_client_from_state_with_optimizer(
            state["tinker_state"]
        ).result()
        self.step_count, self.version = state["step"], state["version"]
        self.trained_seqs = tuple(state["trained_seqs"])
        self.ledger = [list(seqs) for seqs in state["ledger"]]
        logger.info("resumed from %s at step %d", state["tinker_state"], self.step_count)
        return state


def _drift(
    samples: list[TrainSample], outputs: list[Any], clip: dict[str, float], trained: int
) -> dict[str, float]:
    """How far the service's log-probs (before the step) lie from the rollout's: tokens
    whose ratio PPO clips (`clipped` of `tokens`), and the |learner - rollout| gap (sum,
    largest, tokens) over turns that version `trained` sampled."""
    sums = dict.fromkeys(("gap", "gap_max", "gap_tokens", "clipped", "tokens"), 0.0)
    low, high = clip["clip_low_threshold"], clip["clip_high_threshold"]
    for sample, out in zip(samples, outputs, strict=True):
        if not sample.completion_ids:
            continue
        learner = np.asarray(out["logprobs"].tolist()[-len(sample.completion_ids) :])
        rollout = np.asarray(sample.rollout_logprobs)
        ratio = np.exp(learner - rollout)
        sums["clipped"] += int(((ratio < low) | (ratio > high)).sum())
        sums["tokens"] += len(ratio)
        if sample.policy_version != trained:
            continue  # only turns the trained adapter sampled say how far it drifted
        gaps = np.abs(learner - rollout)
        sums["gap"] += float(gaps.sum())
        sums["gap_max"] = max(sums["gap_max"], float(gaps.max()))
        sums["gap_tokens"] += len(gaps)
    return sums


def tinker_service(backend: BackendConfig) -> Any:
    """A `tinker.ServiceClient` on `backend.base_url` (else $TINKER_BASE_URL, else Tinker's
    own) with `backend.api_key` (else $TINKER_API_KEY)."""
    import tinker

    return tinker.ServiceClient(
        base_url=backend.base_url or os.environ.get("TINKER_BASE_URL") or None,
        api_key=backend.api_key or os.environ.get("TINKER_API_KEY"),
    )
