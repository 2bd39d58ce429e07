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
from pathlib import Path

from agents.serving.proxy import LIVE_ENV_ID
from agents.store import Store
from agents.trajectory import SessionStatus, TurnStatus, TurnType
from trainers.config import RunConfig
from trainers.evaluation import Evaluator
from trainers.judge import Judge
from trainers.judging import JudgeLoop
from trainers.learner import Learner, StepMetrics
from trainers.metrics import CHECKPOINT_KEY, MetricsWriter
from trainers.progress import Progress
from trainers.rollouts import EnvSlot, EpisodePlayer, MakeEnv, RolloutLoop
from trainers.samples import reward_weights
from trainers.sft import NoDemonstrations, SFTLoop, prepare_demonstrations
from trainers.training import Publish, TrainLoop

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 0.25
"""How long a loop with nothing to do waits before looking at the store again."""


class Pipeline:
    """Runs the loops of one training run.

    Args:
        config: the run's config.
        run_dir: where metrics go (the store, adapters and checkpoints live there too).
        store: the run's store.
        learner: the LoRA learner.
        judge: scores turns and writes hints.
        judges_by_env: judges of particular envs (`env.<name>.judge`), by name.
        make_envs: one factory per env that rolls out (with `method=sft`: that
            demonstrates), by name; empty when only live clients feed the store.
        player: where the rollouts' episodes are played (`trainers.rollouts.LocalPlayer`
            through the proxy, or a Ray cluster's workers); needed with `make_envs`.
        publish: hands a new adapter version to the server.
        metrics: where step metrics go.
        evaluator: plays held-out tasks before, during and after training (`eval`).
    """

    def __init__(
        self,
        config: RunConfig,
        run_dir: Path,
        store: Store,
        learner: Learner,
        judge: Judge,
        judges_by_env: Mapping[str, Judge],
        make_envs: Mapping[str, MakeEnv],
        player: EpisodePlayer | None,
        publish: Publish,
        metrics: MetricsWriter | None = None,
        evaluator: Evaluator | None = None,
    ):
        if make_envs and player is None:
            raise ValueError("a pipeline that rolls out needs a player for its episodes")
        self.config, self.run_dir, self.store, self.learner = config, Path(run_dir), store, learner
        self.publish, self.metrics, self.evaluator = publish, metrics, evaluator
        self.progress = Progress()
        self._stop = threading.Event()
        self._failure: tuple[str, BaseException] | None = None
        """The first loop that stopped on an error, and the error."""
        self.make_envs = make_envs
        self.sft = config.method.name == "sft"
        # an adapter to start from (`trainer.init_adapter`, an SFT run's) is the warm start
        warm = not (self.sft or config.trainer.init_adapter)
        self.warm_start = config.sft.warm_start_steps if warm else 0
        """Supervised steps on demonstrations before an RL method's first step."""
        self.total_steps = config.trainer.max_steps + self.warm_start
        if evaluator is not None and self.warm_start:
            evaluator.switch_step = self.warm_start
        kinds = {name: env.judge or config.judge.kind for name, env in config.env.items()}
        self.judging = JudgeLoop(
            store, judge, judges_by_env, config.method.name in ("opd", "combine"), self.progress
        )
        self.training: TrainLoop | SFTLoop
        self.slots: dict[str, EnvSlot] = {}
        self.rollouts: RolloutLoop | None = None
        self.supervised = (
            SFTLoop(
                config.trainer,
                config.sft,
                learner,
                store,
                publish,
                self.progress,
                metrics,
                config.seed,
            )
            if self.sft or self.warm_start
            else None
        )
        if self.supervised is not None and self.sft:
            # supervised fine-tuning plays no episode: its envs only demonstrate
            self.training = self.supervised
        else:
            self.training = training = TrainLoop(
                config.trainer,
                config.method,
                config.env,
                {
                    # live conversations (the proxy's "live" sessions) have no outcome
                    LIVE_ENV_ID: reward_weights(None, config.method, config.judge.kind),
                    **{
                        name: reward_weights(env, config.method, kinds[name])
                        for name, env in config.env.items()
                    },
                },
                learner,
                store,
                publish,
                self.progress,
                metrics,
                run_dir,
                max_signalless_groups=config.rollout.max_signalless_groups,
            )
            self.slots = {
                name: EnvSlot(name, config.env[name], make) for name, make in make_envs.items()
            }
            if self.slots and player is not None:
                self.rollouts = RolloutLoop(
                    config.rollout,
                    self.slots,
                    player,
                    config.sampling,
                    config.seed,
                    self.progress,
                    has_room=lambda: training.waiting() < config.trainer.backlog,
                )

    # -- running -------------------------------------------------------------------------
    def run(self, overlap: bool = True) -> list[StepMetrics]:
        """Trains for `trainer.max_steps` steps (after `sft.warm_start_steps` supervised
        ones); returns the metrics of the steps this process took (metrics.jsonl holds the
        whole run's)."""
        self.resume()
        if self.supervised is not None:
            prepare_demonstrations(
                self.config.sft,
                self.make_envs,
                self.store,
                self.learner,
                self.config.model.name,
                self.config.seed,
                # what the engine serves: its configured context, else the model's own
                self.config.engine.context_length
                or getattr(self.learner.model.config, "max_position_embeddings", None),
            )
        try:
            if self.config.eval.before and (self.evaluator is None or not self.evaluator.started):
                self._evaluate()  # the before, which a resumed run took in its first process
            if self.warm_start:
                self._warm_start()
            self._resume_evaluation()
            if self.rollouts is not None:
                self.rollouts.start(self.store)
            if overlap:
                self._run_overlapped()
            else:
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

    def _warm_start(self) -> None:
        """`sft.warm_start_steps` supervised steps before RL (skipped where a resumed run
        took them), evaluated at their end; then the demonstrations leave the pipeline:
        their turns, trained or not, are never judged or trained as rollouts. Skipped,
        with a warning, where no env could demonstrate.

        Raises:
            DemonstrationsFailed: every demonstration failed (stops the run before RL).
        """
        assert self.supervised is not None
        try:
            self.supervised.demonstrations()
        except NoDemonstrations as none:  # all failed (DemonstrationsFailed): the run stops
            logger.warning("no warm start: %s", none)
            self.total_steps = self.config.trainer.max_steps
            return
        while self.learner.step_count < self.warm_start:
            self.supervised.step()
        if self.learner.step_count == self.warm_start:
            # the switch's evaluation; a run stopped during it takes it up again (the
            # evaluator plays only what that step's evaluation lacks)
            self._evaluate()
        self.supervised.retire()

    def _run_overlapped(self) -> None:
        loops = [] if self.sft else [self._loop("judge", self.judging.run)]
        if self.rollouts is not None:
            loops.append(self._loop("rollout", self.rollouts.run))
        for loop in loops:
            loop.start()
        try:
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
                < self.config.trainer.batch_turns
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

    def _resume_evaluation(self) -> None:
        """The evaluation due after the step a resumed run stopped at (`eval.every`), which
        the stop cut short: the loops take it only after a step they take themselves."""
        step = self.learner.step_count
        if self.evaluator is not None and 0 < step < self.total_steps and self.evaluator.due(step):
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
        episodes a stopped run left open are failed (their environments are gone; their
        turns are judged as they are, never continued); the metrics hold the checkpointed
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
            self.store.finish_session(session_id, status=SessionStatus.FAILED)
        if abandoned:
            logger.info("failed %d episodes a stopped run left open", len(abandoned))
        state = self.learner.load_checkpoint()
        if self.metrics is not None:
            cursor = state["cursor"] if state is not None else {}
            records = self.metrics.resume(self.learner.step_count, cursor.get(CHECKPOINT_KEY, []))
            if self.evaluator is not None:
                self.evaluator.restore(records)
        if state is None:
            if self.config.trainer.init_adapter:
                adapter = self.learner.start_from(self.config.trainer.init_adapter)
                self.publish(str(adapter), self.learner.version)
            return
        self.store.mark_trained(self.learner.trained_seqs)
        adapter = self.run_dir / "adapters" / f"v{self.learner.version}"
        self.publish(str(adapter), self.learner.version)
        self.progress.turns_trained = self.store.count_turns(TurnStatus.TRAINED)
