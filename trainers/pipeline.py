"""The asynchronous pipeline: rollout, judging and training loops that never wait for each
other, meeting only at the store (and the serving loop, which runs beside them).

- rollout: plays groups of episodes (`env.group_size` rollouts of one task, concurrently,
  so a batching engine batches them) and stores every turn; it pauses while more than
  `trainer.max_backlog` turns wait to be trained (the bounded queue; two batches by
  default, so the rollout plays one batch ahead while the learner trains);
- judging: reads collected main turns, asks the judge, stores the judgement;
- training: once enough judged turns of complete groups are there, selects samples by the
  method, takes one optimiser step, checkpoints, marks the turns, and publishes the new
  adapter to the engine, which swaps it in without stopping service.

With `overlap=False` the same three phases run strictly one after the other (the baseline of
the async-speedup benchmark). A restart on the same run directory resumes from the last
checkpoint: turns it trained are marked trained, turns it did not are trained later.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym

from agents.compose import sampling_params
from agents.engines.base import Engine
from agents.rollout import EpisodeSummary, Seat, run_episode
from agents.store import Store
from agents.trajectory import Session, SessionStatus, Turn, TurnStatus, TurnType
from trainers.config import RunConfig
from trainers.judge import Judge
from trainers.learner import Learner, StepMetrics
from trainers.metrics import MetricsWriter
from trainers.samples import Selection, baseline_key, first_batch, select

logger = logging.getLogger(__name__)

Publish = Callable[[str, int], None]

MAX_EMPTY_EPISODES = 32
"""Episodes in a row that end before their first turn before the run stops: one is data (a
task past the context), a run of them is an env or a server that is broken for good."""

_IDLE_POLL_S = 0.25
"""How long a loop with nothing to do waits before looking at the store again."""


@dataclass
class Progress:
    """Live counters, read by the progress display (plain ints: reads need no lock)."""

    episodes: int = 0
    episode_reward: float = 0.0
    rollout_tokens: int = 0
    """Completion tokens the rollouts sampled."""
    turns_judged: int = 0
    turns_trained: int = 0
    turns_dropped: int = 0
    steps: list[StepMetrics] = field(default_factory=list)
    recent_rewards: list[float] = field(default_factory=list)

    @property
    def mean_recent_reward(self) -> float:
        window = self.recent_rewards[-32:]
        return sum(window) / len(window) if window else 0.0


class Pipeline:
    """Runs the loops of one training run.

    Args:
        config: the run's config.
        run_dir: where metrics go (the store, adapters and checkpoints live there too).
        engine: serves the policy (the judge's and teacher's base model too).
        store: the run's store.
        learner: the LoRA learner.
        judge: scores turns and writes hints.
        make_env: builds one environment instance; None when only live clients feed the store.
        seat: where the rollouts reach the policy (the proxy, `agents.rollout.ProxySeat`);
            needed with `make_env`.
        publish: hands a new adapter version to the server (defaults to the engine).
        metrics: where step metrics go.
    """

    def __init__(
        self,
        config: RunConfig,
        run_dir: Path,
        engine: Engine,
        store: Store,
        learner: Learner,
        judge: Judge,
        make_env: Callable[[], gym.Env[Any, Any]] | None,
        seat: Seat | None = None,
        publish: Publish | None = None,
        metrics: MetricsWriter | None = None,
    ):
        if make_env is not None and seat is None:
            raise ValueError("a pipeline that rolls out needs a seat to reach the policy")
        self.config, self.run_dir, self.engine, self.store = config, Path(run_dir), engine, store
        self.learner, self.judge, self.make_env, self.seat = learner, judge, make_env, seat
        self.publish = publish or engine.load_adapter
        self.metrics = metrics
        self.progress = Progress()
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._envs: list[gym.Env[Any, Any]] = []
        self._envs_lock = threading.Lock()
        self._task_ids: list[str] = []
        self._group = 0
        self._in_training = 0
        """Turns of the batch the learner is on (still judged in the store until done)."""
        self._failures_in_a_row = 0
        """Episodes in a row that ended before their first turn (a broken env or server)."""
        self._failure: tuple[str, BaseException] | None = None
        """The first loop that stopped on an error, and the error."""

    # -- running -------------------------------------------------------------------------
    def run(self, overlap: bool = True) -> list[StepMetrics]:
        """Trains for `trainer.max_steps` steps; returns each step's metrics."""
        self._started = time.monotonic()
        self.resume()
        if self.make_env is not None:
            probe = self._borrow_env()
            self._task_ids = list(probe.unwrapped.task_ids())  # type: ignore[attr-defined]
            random.Random(self.config.seed).shuffle(self._task_ids)
            # a resumed run goes on with new tasks and seeds, not the ones it already played
            self._group = len(self.store.sessions()) // self.config.env.group_size
            self._return_env(probe)
        try:
            if overlap:
                self._run_overlapped()
            else:
                self._run_alternating()
        finally:
            self._stop.set()
            for env in self._envs:
                env.close()
        return self.progress.steps

    def stop(self) -> None:
        """Asks every loop to finish what it is doing and return."""
        self._stop.set()

    def _run_overlapped(self) -> None:
        loops = [self._loop("judge", self._judge_loop)]
        if self.make_env is not None:
            loops.append(self._loop("rollout", self._rollout_loop))
        for loop in loops:
            loop.start()
        try:
            while (
                self.learner.step_count < self.config.trainer.max_steps and not self._stop.is_set()
            ):
                if self._train_once() is None:
                    time.sleep(_IDLE_POLL_S)
            if self._failure is not None:
                name, error = self._failure
                raise RuntimeError(f"the {name} loop stopped the run: {error}") from error
        finally:
            self._stop.set()
            for loop in loops:
                loop.join(timeout=600)

    def _run_alternating(self) -> None:
        if self.make_env is None:
            raise ValueError("overlap=False needs an environment to roll out")
        while self.learner.step_count < self.config.trainer.max_steps:
            while self.store.count_turns(TurnStatus.COLLECTED) < self.config.trainer.batch_turns:
                self._play_group()
            while self._judge_pending():
                pass
            if self._train_once() is None:
                self._play_group()

    def _loop(self, name: str, body: Callable[[], None]) -> threading.Thread:
        """A loop's thread: an error in it stops every loop and is raised by `run`."""

        def guarded() -> None:
            try:
                body()
            except BaseException as error:
                logger.exception("the %s loop failed", name)
                if self._failure is None:
                    self._failure = (name, error)
                self._stop.set()

        return threading.Thread(target=guarded, name=name, daemon=True)

    def resume(self) -> None:
        """Restores the last checkpoint and reconciles the store with it: episodes a stopped
        run left open are failed (their environments are gone; their turns are judged as
        they are, never continued)."""
        abandoned = [
            s.session_id
            for s in self.store.sessions(status=SessionStatus.OPEN)
            if s.env_id != "live"
        ]
        for session_id in abandoned:
            self.store.end_turns(
                (t.session_id, t.index) for t in self.store.session(session_id).turns
            )
            self.store.finish_session(session_id, status=SessionStatus.FAILED)
        if abandoned:
            logger.info("failed %d episodes a stopped run left open", len(abandoned))
        state = self.learner.load_checkpoint()
        if state is None:
            return
        self.store.mark_trained(self.learner.trained_seqs)
        adapter = self.run_dir / "adapters" / f"v{self.learner.version}"
        self.publish(str(adapter), self.learner.version)
        self.progress.turns_trained = self.store.count_turns(TurnStatus.TRAINED)

    # -- rollout -------------------------------------------------------------------------
    def _rollout_loop(self) -> None:
        while not self._stop.is_set():
            # the batch being trained no longer waits: the rollout plays the next meanwhile
            waiting = (
                self.store.count_turns(TurnStatus.COLLECTED)
                + self.store.count_turns(TurnStatus.JUDGED)
                - self._in_training
            )
            if waiting >= self.config.trainer.backlog:
                time.sleep(_IDLE_POLL_S)
                continue
            self._play_group()

    def _play_group(self) -> list[EpisodeSummary]:
        """`group_size` episodes of one task, played concurrently."""
        size = self.config.env.group_size
        task_id = self._task_ids[self._group % len(self._task_ids)]
        group_id = f"{task_id}#{uuid.uuid4().hex[:8]}"
        seeds = [self.config.seed * 100_003 + self._group * size + i for i in range(size)]
        self._group += 1
        with ThreadPoolExecutor(size) as pool:
            results = list(pool.map(lambda seed: self._episode(task_id, group_id, seed), seeds))
        for result in results:
            self._failures_in_a_row = self._failures_in_a_row + 1 if result.turns == 0 else 0
            if self._failures_in_a_row >= MAX_EMPTY_EPISODES:
                raise RuntimeError(
                    f"{MAX_EMPTY_EPISODES} episodes in a row ended before their first turn; "
                    f"the last: {result.error}"
                )
            self.progress.episodes += 1
            self.progress.rollout_tokens += result.completion_tokens
            self.progress.recent_rewards.append(result.total_reward)
        return results

    def _episode(self, task_id: str, group_id: str, seed: int) -> EpisodeSummary:
        assert self.seat is not None  # the constructor requires it with make_env
        env = self._borrow_env()
        summary = None
        try:
            summary = run_episode(
                env,
                self.seat,
                env_id=self.config.env.id,
                task_id=task_id,
                seed=seed,
                group_id=group_id,
                sampling=sampling_params(self.config.sampling, seed),
            )
            return summary
        finally:
            if summary is not None and summary.error is None:
                self._return_env(env)
            else:  # an env an episode broke off in may be broken itself: a fresh one next
                env.close()

    def _borrow_env(self) -> gym.Env[Any, Any]:
        assert self.make_env is not None
        with self._envs_lock:
            if self._envs:
                return self._envs.pop()
        return self.make_env()

    def _return_env(self, env: gym.Env[Any, Any]) -> None:
        with self._envs_lock:
            self._envs.append(env)

    # -- judging -------------------------------------------------------------------------
    def _judge_loop(self) -> None:
        while not self._stop.is_set():
            if not self._judge_pending():
                time.sleep(_IDLE_POLL_S)

    def _judge_pending(self) -> bool:
        """Judges the collected main turns that can be judged now; True if any were."""
        # settled turns only: a window of turns still waiting for their next state (live
        # users who have not answered yet) would hold back every turn behind it
        pending = self.store.turns(
            status=TurnStatus.COLLECTED, turn_type=TurnType.MAIN, limit=256, settled=True
        )
        sessions = {
            s.session_id: s
            for s in self.store.sessions(session_ids={t.session_id for _, t in pending})
        }
        want_hint = self.config.method.name in ("opd", "combine")
        judged = 0
        for _, turn in pending:
            if self._stop.is_set():
                break
            judgement = self.judge.judge(turn, sessions[turn.session_id], want_hint)
            if judgement is not None:
                self.store.set_judgement(turn.session_id, turn.index, judgement)
                judged += 1
        self.progress.turns_judged += judged
        return judged > 0

    # -- training ------------------------------------------------------------------------
    def _train_once(self) -> StepMetrics | None:
        """One optimiser step if enough judged turns are ready; None otherwise."""
        # a COUNT first: loading and decoding the judged turns on every poll took a third
        # of a core and the GIL from the engine thread while a batch filled up
        if self.store.count_turns(TurnStatus.JUDGED) < self.config.trainer.batch_turns:
            return None
        ready, sessions = self._ready_turns()
        if len(ready) < self.config.trainer.batch_turns:
            return None
        selection = self._select(ready, sessions)
        # Dropped at once: their groups are complete, so no later turn gives them a signal
        # (and staleness only grows). Left judged, they filled the backlog and paused the
        # rollout while the learner waited for turns it could train.
        self.store.mark_trained(selection.dropped, TurnStatus.DROPPED)
        self.progress.turns_dropped += len(selection.dropped)
        if len(selection.samples) < self.config.trainer.batch_turns:
            return None
        # `batch_turns` a step; the rest stay judged for the next one
        keys = {seq: baseline_key(turn, sessions[turn.session_id]) for seq, turn in ready}
        batch = first_batch(selection.samples, keys, self.config.trainer.batch_turns)
        self._in_training = len(batch)
        try:
            metrics = self.learner.step(list(batch))
            adapter = self.learner.save_adapter()
            self.learner.save_checkpoint(
                {"trained_turns": self.progress.turns_trained + len(batch)}
            )
            self.store.mark_trained([s.seq for s in batch])
        finally:
            self._in_training = 0
        published = time.perf_counter()
        self.publish(str(adapter), self.learner.version)
        publish_ms = (time.perf_counter() - published) * 1e3
        self.progress.turns_trained += len(batch)
        self.progress.steps.append(metrics)
        self._log_metrics(metrics, selection, _mean_judge_score(ready), publish_ms)
        return metrics

    def _select(self, ready: list[tuple[int, Turn]], sessions: dict[str, Session]) -> Selection:
        return select(
            ready,
            sessions,
            self.config.method,
            outcome_is_reward=self.config.env.outcome_is_reward,
            current_version=self.learner.version,
            max_staleness=self.config.trainer.max_staleness,
        )

    def _ready_turns(self) -> tuple[list[tuple[int, Turn]], dict[str, Session]]:
        """Judged main turns whose whole group is finished and judged (for the baseline)."""
        judged = self.store.turns(status=TurnStatus.JUDGED, turn_type=TurnType.MAIN)
        sessions = {
            s.session_id: s
            for s in self.store.sessions(session_ids={t.session_id for _, t in judged})
        }
        groups = {s.group_id for s in sessions.values() if s.group_id}
        members = self.store.group_sessions(groups)
        sessions |= {s.session_id: s for s in members}
        unjudged = {
            t.session_id
            for _, t in self.store.turns(status=TurnStatus.COLLECTED, turn_type=TurnType.MAIN)
        }
        size = self.config.env.group_size
        complete = set()
        for group in groups:
            mates = [s for s in members if s.group_id == group]
            finished = all(
                s.status != SessionStatus.OPEN and s.session_id not in unjudged for s in mates
            )
            if finished and len(mates) >= size:
                complete.add(group)
        ready = [
            (q, t) for q, t in judged if (sessions[t.session_id].group_id or "") in complete | {""}
        ]
        return ready, sessions

    def _log_metrics(
        self,
        metrics: StepMetrics,
        selection: Selection,
        judge_score: float | None,
        publish_ms: float,
    ) -> None:
        row = asdict(metrics) | {
            "elapsed_s": round(time.monotonic() - self._started, 3),
            "publish_ms": round(publish_ms, 2),
            "rollout_tokens": self.progress.rollout_tokens,
            "judge_score": judge_score,
            "dropped": len(selection.dropped),
            "stale": selection.stale,
            "episodes": self.progress.episodes,
            "recent_reward": self.progress.mean_recent_reward,
        }
        if self.metrics is not None:
            self.metrics.write(metrics.step, row)
        logger.info(
            "step %d: loss %.4f, %d turns, reward %.3f, %.1fs",
            metrics.step,
            metrics.loss,
            metrics.turns,
            self.progress.mean_recent_reward,
            metrics.seconds,
        )


def _mean_judge_score(turns: list[tuple[int, Turn]]) -> float | None:
    """The judge's mean verdict on the turns a step drew from: with a judge reading real
    feedback, the training-time curve of how often the user was satisfied."""
    scores = [t.judgement.score for _, t in turns if t.judgement is not None]
    return sum(scores) / len(scores) if scores else None
