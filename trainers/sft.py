"""Supervised fine-tuning (`method=sft`): the negative log-likelihood of demonstrations.

Demonstrations are sessions of the run's store marked as such (`agents.demonstrations`):
recorded at the start of the run by each env's reference agent, or imported from a parquet
export of any store. Each optimiser step takes the next `trainer.batch_turns` of their main
turns in a seeded order that is reshuffled every epoch; the position follows from the step
count alone, so a resumed run goes on with the very batches it would have taken. Each step's
adapter is published to the engine as RL's are, and the evaluator plays held-out tasks
with it, so an SFT run reports its held-out score before and after like any run.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict

import gymnasium as gym

from agents import models, vision
from agents.demonstrations import (
    DEMONSTRATION,
    Expand,
    NoReferenceAgent,
    end_reason,
    import_parquet,
    record_demonstrations,
)
from agents.rollout import EpisodeSummary
from agents.store import Store
from agents.trajectory import Turn, TurnStatus, TurnType
from trainers.config import SFTConfig, TrainerConfig
from trainers.learner import Learner
from trainers.learning import StepMetrics, TrainSample
from trainers.metrics import CHECKPOINT_KEY, MetricsWriter, record
from trainers.progress import Progress

logger = logging.getLogger(__name__)

REFERENCE = "reference"
"""`sft.demonstrations` for the envs' reference agents."""


class NoDemonstrations(ValueError):
    """The store holds no demonstration: none of the run's envs has a reference agent to
    record one, and none was imported. A warm start is skipped; an SFT run cannot train."""


class DemonstrationsFailed(ValueError):
    """Demonstrations were recorded (or imported) and every one failed: supervised steps
    would teach nothing, so the run stops before any RL.

    Args:
        failures: for each env, how many failed and why the first one did (`failures`).
    """

    def __init__(self, failures: str):
        super().__init__(
            f"{failures}: nothing to imitate; fix what failed them, or set "
            "sft.warm_start_steps=0 to start RL from the base model"
        )


def prepare_demonstrations(
    sft: SFTConfig,
    make_envs: Mapping[str, Callable[[], gym.Env]],
    store: Store,
    learner: Learner,
    model_name: str,
    seed: int,
    context_length: int | None,
) -> None:
    """Puts the run's demonstrations into its store, once: a resumed run finds them there.

    Reference demonstrations are scored by the learner's current policy (their stored
    log-probs), whose version they carry. An env whose demonstrations all failed is named in
    a warning while another env's train.

    Raises:
        DemonstrationsFailed: no demonstration of any env would train.
    """
    if any(DEMONSTRATION in s.metadata for s in store.sessions()):
        return
    if sft.demonstrations != REFERENCE:
        import_parquet(store, sft.demonstrations)
        return
    tokenizer = models.load_tokenizer(model_name)
    recorded: dict[str, list[EpisodeSummary]] = {}
    for name, make in make_envs.items():
        try:
            recorded[name] = record_demonstrations(
                make,
                name,
                store,
                tokenizer,
                sft.episodes,
                learner.logprobs,
                version=learner.version,
                seed=seed,
                context_length=context_length,
                expand=image_expansion(learner),
            )
        except NoReferenceAgent as missing:  # the other envs may still demonstrate
            logger.warning("no demonstrations of %s: %s", name, missing)
    floor = sft.min_outcome_reward
    failed = {  # `SFTLoop.demonstrations`' choice: turns, and an outcome above the floor
        name: summaries
        for name, summaries in recorded.items()
        if not any(s.turns and (floor is None or s.total_reward > floor) for s in summaries)
    }
    if failed and len(failed) == len(recorded):
        raise DemonstrationsFailed(failures(failed, floor))
    if failed:
        logger.warning("%s; the other envs' demonstrations train", failures(failed, floor))


def image_expansion(learner: Learner) -> Expand | None:
    """A vision-language learner's expansion of each image placeholder in a prompt's ids to
    its image's tokens (the engine's rule, `agents.vision.expand`); None for a text one."""
    if learner.pixels is None:
        return None
    return functools.partial(learner.pixels.expanded, pad_id=learner.model.config.image_token_id)


def failures(failed: Mapping[str, Sequence[EpisodeSummary]], floor: float | None) -> str:
    """Says, for each env, that its demonstrations all failed, and why the first one did
    (the error that cut it short, or its end and a reward not above `floor`)."""
    parts = []
    for name, summaries in failed.items():
        first = summaries[0]
        reason = end_reason(first)
        if first.error is None and floor is not None and first.total_reward <= floor:
            reason += f", not above sft.min_outcome_reward={floor}"
        parts.append(
            f"all {len(summaries)} demonstrations of env {name!r} failed (the first: {reason})"
        )
    return "; ".join(parts)


class SFTLoop:
    """Takes optimiser steps on the store's demonstrations.

    Args:
        trainer: batch size (`batch_turns`).
        sft: which demonstrations train.
        learner: the LoRA learner.
        store: the run's store, holding the demonstrations.
        publish: hands a new adapter version to the server.
        progress: the run's counters.
        metrics: where each step's row goes.
        seed: seeds the order of each epoch.
    """

    def __init__(
        self,
        trainer: TrainerConfig,
        sft: SFTConfig,
        learner: Learner,
        store: Store,
        publish: Callable[[str, int], None],
        progress: Progress,
        metrics: MetricsWriter | None,
        seed: int,
    ):
        self.trainer, self.sft, self.learner, self.store = trainer, sft, learner, store
        self.publish, self.progress, self.metrics, self.seed = publish, progress, metrics, seed
        self._turns: list[tuple[int, Turn]] | None = None
        self._started = time.monotonic()

    def demonstrations(self) -> list[tuple[int, Turn]]:
        """The main turns that train, by store seq (read once: they never change).

        Raises:
            NoDemonstrations: none was recorded or imported.
            DemonstrationsFailed: every one failed (a resumed run, or an imported export,
                finds them so in the store).
        """
        if self._turns is None:
            floor = self.sft.min_outcome_reward
            chosen = {
                s.session_id
                for s in self.store.sessions()
                if DEMONSTRATION in s.metadata
                and (floor is None or (s.outcome_reward is not None and s.outcome_reward > floor))
            }
            self._turns = [
                (seq, turn)
                for seq, turn in self.store.turns(turn_type=TurnType.MAIN)
                if turn.session_id in chosen and turn.completion_token_ids
            ]
            if not self._turns:
                raise self._none_trains()
            logger.info("%d demonstration turns from %d sessions", len(self._turns), len(chosen))
        return self._turns

    def _none_trains(self) -> ValueError:
        """Why no demonstration of the store trains, as the error to raise."""
        recorded: dict[str, list[EpisodeSummary]] = {}
        for session in self.store.sessions():  # oldest first: the first failure leads
            if DEMONSTRATION in session.metadata:
                recorded.setdefault(session.env_id, []).append(EpisodeSummary.of(session))
        if not recorded:
            return NoDemonstrations(
                "no demonstration to learn from: none of the run's envs has a reference "
                "agent to record one, and none was imported (sft.demonstrations)"
            )
        return DemonstrationsFailed(failures(recorded, self.sft.min_outcome_reward))

    def retire(self) -> None:
        """Drops the demonstration turns no step trained, so that an RL method that
        follows never judges or trains them as rollouts."""
        sessions = {s.session_id for s in self.store.sessions() if DEMONSTRATION in s.metadata}
        leftover = [
            seq
            for seq, turn in self.store.turns(status=TurnStatus.COLLECTED)
            if turn.session_id in sessions
        ]
        self.store.mark_trained(leftover, TurnStatus.DROPPED)

    def batch(self, step: int) -> list[tuple[int, Turn]]:
        """The turns of optimiser step `step` (from 0): `batch_order` over the
        demonstrations."""
        turns = self.demonstrations()
        order = batch_order(len(turns), self.trainer.batch_turns, step, self.seed)
        return [turns[i] for i in order]

    def step(self) -> StepMetrics | None:
        """One optimiser step on the next batch of demonstrations."""
        batch = self.batch(self.learner.step_count)
        samples = [
            TrainSample(
                seq,
                turn.prompt_token_ids,
                turn.completion_token_ids,
                turn.completion_logprobs,
                (1.0,) * len(turn.completion_token_ids),
                turn.policy_version,
                images=tuple(vision.images_of(turn.prompt_messages, None)),
            )
            for seq, turn in batch
        ]
        metrics = self.learner.step(samples, objective="nll", lr=self.sft.lr)
        adapter = self.learner.save_adapter()
        epoch = (metrics.step * self.trainer.batch_turns) / len(self.demonstrations())
        row = asdict(metrics) | {
            "elapsed_s": round(time.monotonic() - self._started, 3),
            "epoch": round(epoch, 3),
            "demonstrations": len(self.demonstrations()),
        }
        # the row rides in the checkpoint: a kill before it reaches metrics.jsonl below
        # loses nothing (`trainers.metrics` says the rule)
        self.learner.save_checkpoint(
            {
                "trained_turns": self.progress.turns_trained + len(batch),
                CHECKPOINT_KEY: [record(metrics.step, row)],
            }
        )
        self.store.mark_trained([seq for seq, _ in batch])
        self.publish(str(adapter), self.learner.version)
        self.progress.turns_trained += len(batch)
        self.progress.steps.append(metrics)
        if self.metrics is not None:
            self.metrics.write(metrics.step, row)
        logger.info(
            "sft step %d: nll %.4f over %d tokens, epoch %.2f, %.1fs",
            metrics.step,
            metrics.loss,
            metrics.tokens,
            epoch,
            metrics.seconds,
        )
        return metrics


def batch_order(count: int, batch: int, step: int, seed: int) -> list[int]:
    """Indices (into `count` items) of step `step`'s batch of `batch`: consecutive slices of
    a seeded permutation per epoch, an epoch's tail continuing into the next one's head, so
    every item is seen once per epoch and a batch is never short."""
    indices = []
    for position in range(step * batch, (step + 1) * batch):
        epoch, offset = divmod(position, count)
        indices.append(_permutation(count, seed + epoch)[offset])
    return indices


@functools.lru_cache(maxsize=4)
def _permutation(count: int, seed: int) -> tuple[int, ...]:
    order = list(range(count))
    random.Random(seed).shuffle(order)
    return tuple(order)
