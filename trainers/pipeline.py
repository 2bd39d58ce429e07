"""The asynchronous pipeline: rollout, judging and training loops that never wait for each
other, meeting only at the store (and the serving loop, which runs beside them). Each loop
is a small object with its own sub-config; the pipeline starts them, reconciles the store
on resume, and stops the run when one of them fails.

- rollout (`trainers.rollouts.RolloutLoop`): plays task groups of the run's envs (one or a
  mixture, scheduled by weight), `rollout.groups_in_flight` at a time, every episode through
  the proxy; it pauses while more than `trainer.max_backlog` turns wait to be trained (the
  bounded queue; two batches by default, so the rollout plays one batch ahead while the
  learner trains);
- judging (`trainers.judging.JudgeLoop`): reads collected main turns, asks the judge of
  each one's env, stores the judgement;
- training (`trainers.training.TrainLoop`): once enough judged turns of complete groups are
  there, selects samples by the method, takes one optimiser step, checkpoints, marks the
  turns, and publishes the new adapter to the engine, which swaps it in without stopping
  service. Groups of several rollouts that scored the same are filtered out
  (`method.filter_groups`); `rollout.max_signalless_groups` of one env in a row stop the run.

With `overlap=False` the same three phases run strictly one after the other (the baseline of
the async-speedup benchmark). A restart on the same run directory resumes from the last
checkpoint: turns it trained are marked trained, turns it did not are trained later, and
`metrics.jsonl` keeps each checkpointed step's records once (`trainers.metrics`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from agents.serving.proxy import LIVE_ENV_ID
from agents.store import Store
from agents.trajectory import SessionStatus, TurnStatus, TurnType
from trainers.evaluation import Evaluator
from trainers.judging import JudgeLoop
from trainers.learning import PolicyLearner, StepMetrics
from trainers.metrics import CHECKPOINT_KEY, MetricsWriter
from trainers.progress import Progress
from trainers.rollouts import EnvSlot, RolloutLoop
from trainers.sft import NoDemonstrations, SFTLoop
from trainers.training import Publish, TrainLoop

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 0.25
"""How long a loop with nothing to do waits before looking at the store again."""


@dataclass(frozen=True)
class Schedule:
    """How far the pipeline runs and what it does first (from `trainer`, `sft`, `eval`)."""

    max_steps: int
    """`trainer.max_steps`: the method's optimiser steps."""
    warm_start: int
    """Supervised steps on demonstrations before an RL method's first step (0: none)."""
    batch_turns: int
    """`trainer.batch_turns`: with overlap off, main turns collected before each step."""
    eval_before: bool = False
    """`eval.before`: a held-out evaluation before the first step."""
    init_adapter: str | None = None
    """`trainer.init_adapter`: the adapter a fresh run starts from."""
    sft: bool = False
    """`method=sft`: supervised steps only, no episode played, nothing judged."""


@dataclass(frozen=True)
class Loops:
    """The loops of one run, built by `trainers.compose.build_pipeline`."""

    judging: JudgeLoop
    training: TrainLoop | SFTLoop
    """The method's steps (with `method=sft`, the supervised loop itself)."""
    supervised: SFTLoop | None = None
    """Supervised steps: `method=sft`'s, or an RL method's warm start."""
    rollouts: RolloutLoop | None = None
    """Plays the envs' episodes; None where only live clients feed the store."""
    slots: Mapping[str, EnvSlot] = field(default_factory=dict)
    """The envs that roll out, by name (their pools are closed when the run ends)."""
    prepare: Callable[[], None] | None = None
    """Puts the demonstrations in the store, after the resume (`prepare_demonstrations`)."""


class Pipeline:
    """Runs, resumes and stops the loops of one training run; `trainers.compose` builds
    its parts.

    Args:
        schedule: how far it runs and what it does first.
        loops: the loops it runs.
        run_dir: where adapters live (metrics, the store and checkpoints too).
        store: the run's store.
        learner: the LoRA learner.
        progress: the run's counters, which the loops update.
        publish: hands a new adapter version to the server.
        metrics: where step metrics go.
        evaluator: plays held-out tasks before, during and after training (`eval`).
    """

    def __init__(
        self,
        schedule: Schedule,
        loops: Loops,
        run_dir: Path,
        store: Store,
        learner: PolicyLearner,
        progress: Progress,
        publish: Publish,
        metrics: MetricsWriter | None = None,
        evaluator: Evaluator | None = None,
    ):
        self.schedule, self.run_dir, self.store, self.learner = schedule, run_dir, store, learner
        self.progress, self.publish = progress, publish
        self.metrics, self.evaluator = metrics, evaluator
        self.judging, self.training = loops.judging, loops.training
        self.supervised, self.rollouts = loops.supervised, loops.rollouts
        self.slots, self._prepare = loops.slots, loops.prepare
        self.sft, self.warm_start = schedule.sft, schedule.warm_start
        self.total_steps = schedule.max_steps + schedule.warm_start
        self._stop = threading.Event()
        self._failure: tuple[str, BaseException] | None = None
        """The first loop that stopped on an error, and the error."""

    # -- running -------------------------------------------------------------------------
    def run(self, overlap: bool = True) -> list[StepMetrics]:
        """Trains for `trainer.max_steps` steps (after `sft.warm_start_steps` supervised
        ones); returns the metrics of the steps this process took (metrics.jsonl holds the
        whole run's)."""
        self.resume()
        if self._prepare is not None:
            self._prepare()
        try:
            if self.schedule.eval_before and (self.evaluator is None or not self.evaluator.started):
                self._evaluate()  # the before, which a resumed run took in its first process
            switch_due = self._warm_start() if self.warm_start else False
            if self.rollouts is not None:
                self.rollouts.start(self.store)
            if overlap:
                self._run_overlapped(switch_due)
            else:
                self._evaluate_due(switch_due)
                self._run_alternating()
            self._evaluate()  # the after
        finally:
            self._stop.set()
            for slot in self.slots.values():
                slot.pool.close()
        return self.progress.steps

    def stop(self) -> None:
        """Asks every loop to finish what it is doing and return."""
        self._stop.set()

    def _warm_start(self) -> bool:
        """`sft.warm_start_steps` supervised steps before RL (skipped where a resumed run
        took them); then the demonstrations leave the pipeline: their turns, trained or
        not, are never judged or trained as rollouts. Skipped, with a warning, where no env
        could demonstrate. Returns whether the switch's evaluation is due (the warm start
        ended here, or a run stopped during that evaluation takes it up again: the
        evaluator plays only what it lacks).

        Raises:
            DemonstrationsFailed: every demonstration failed (stops the run before RL).
        """
        assert self.supervised is not None
        try:
            self.supervised.demonstrations()
        except NoDemonstrations as none:  # all failed (DemonstrationsFailed): the run stops
            logger.warning("no warm start: %s", none)
            self.total_steps = self.schedule.max_steps
            return False
        while self.learner.step_count < self.warm_start:
            self.supervised.step()
        self.supervised.retire()
        return self.learner.step_count == self.warm_start

    def _run_overlapped(self, switch_due: bool = False) -> None:
        loops = [] if self.sft else [self._loop("judge", self.judging.run)]
        if self.rollouts is not None:
            loops.append(self._loop("rollout", self.rollouts.run))
        for loop in loops:
            loop.start()
        try:
            # The rollouts of the first RL steps play beside the evaluation due now (the
            # switch's): the same policy version, and the engine decodes both together.
            self._evaluate_due(switch_due)
            while self.learner.step_count < self.total_steps and not self._stop.is_set():
                if self._train_step() is None:
                    time.sleep(_IDLE_POLL_S)
            if self._failure is not None:
                name, error = self._failure
                raise RuntimeError(f"the {name} loop stopped the run: {error}") from error
        finally:
            self._stop.set()
            for loop in loops:
                loop.join(timeout=600)

    def _run_alternating(self) -> None:
        if self.sft:  # nothing to alternate with
            self._run_overlapped()
            return
        if self.rollouts is None:
            raise ValueError("overlap=False needs an environment to roll out")
        while self.learner.step_count < self.total_steps:
            while (
                self.store.count_turns(TurnStatus.COLLECTED, TurnType.MAIN)
                < self.schedule.batch_turns
            ):
                self.rollouts.play_groups()
            while self.judging.judge_pending():
                pass
            if self._train_step() is None:
                self.rollouts.play_groups()

    def _train_step(self) -> StepMetrics | None:
        """One optimiser step if one is ready, and the evaluation due after it."""
        metrics = self.training.step()
        if metrics is not None and self.evaluator is not None:
            if self.evaluator.due(metrics.step) and metrics.step < self.total_steps:
                self._evaluate(between=True)
        return metrics

    def _evaluate_due(self, switch_due: bool) -> None:
        """The evaluation due before the loops' first step: the switch to RL's
        (`switch_due`), or the one after the step a resumed run stopped at (`eval.every`),
        which the stop cut short: the loops take it only after a step they take themselves."""
        step, evaluator = self.learner.step_count, self.evaluator
        if switch_due:
            self._evaluate()
        elif evaluator is not None and 0 < step < self.total_steps and evaluator.due(step):
            self._evaluate(between=True)

    def _evaluate(self, between: bool = False) -> None:
        """`between`: one of the every-`eval.every`-steps evaluations, not the before, the
        switch to RL or the after (`eval.pass_k_at`)."""
        if self.evaluator is not None and self.evaluator.enabled:
            self.evaluator.evaluate(self.learner.step_count, self.learner.version, between)

    def _loop(self, name: str, body: Callable[[threading.Event], None]) -> threading.Thread:
        """A loop's thread: an error in it stops every loop and is raised by `run`."""

        def guarded() -> None:
            try:
                body(self._stop)
            except BaseException as error:
                logger.exception("the %s loop failed", name)
                if self._failure is None:
                    self._failure = (name, error)
                self._stop.set()

        return threading.Thread(target=guarded, name=name, daemon=True)

    def resume(self) -> None:
        """Restores the last checkpoint and reconciles the store and metrics.jsonl with it:
        episodes a stopped run left open end `interrupted` (their environments are gone,
        and an outcome the stop cut short says nothing of the policy: their turns are
        dropped, never continued nor trained on); the metrics hold the checkpointed
        steps' records once each (`MetricsWriter.resume`), and the evaluator takes back its
        evaluations from them."""
        abandoned = [
            s.session_id
            for s in self.store.sessions(status=SessionStatus.OPEN)
            if s.env_id != LIVE_ENV_ID
        ]
        for session_id in abandoned:
            self.store.end_turns(
                (t.session_id, t.index) for t in self.store.session(session_id).turns
            )
            self.store.finish_session(
                session_id, status=SessionStatus.INTERRUPTED, reason="the run stopped"
            )
        if abandoned:
            logger.info("interrupted %d episodes a stopped run left open", len(abandoned))
        state = self.learner.load_checkpoint()
        if self.metrics is not None:
            cursor = state["cursor"] if state is not None else {}
            records = self.metrics.resume(self.learner.step_count, cursor.get(CHECKPOINT_KEY, []))
            if self.evaluator is not None:
                self.evaluator.restore(records)
        if state is None:
            if self.schedule.init_adapter:
                adapter = self.learner.start_from(self.schedule.init_adapter)
                self.publish(str(adapter), self.learner.version)
            return
        self.store.mark_trained(self.learner.trained_seqs)
        adapter = self.run_dir / "adapters" / f"v{self.learner.version}"
        self.publish(str(adapter), self.learner.version)
        self.progress.turns_trained = self.store.count_turns(TurnStatus.TRAINED)
