"""The rollout side of a run: which of a mixture's envs plays next, pooled env instances,
and the loop that keeps `rollout.groups_in_flight` task groups in flight.

A group is `group_size` episodes of one task of one env, played concurrently; several
groups in flight (from any of the envs) let a batching engine decode all their turns
together. Every episode reaches the policy through the proxy and is recorded there under
its env's name, so the judge, the reward weights and the metrics can look up each session's
env. Where an episode is played is the `EpisodePlayer`'s business: `LocalPlayer` plays it
in this process with the slot's pooled env instances; `trainers.cluster.RayPlayer` hands it
to a rollout worker on a Ray cluster (`cluster=ray`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import gymnasium as gym

from agents.compose import sampling_params
from agents.config import EnvConfig, SamplingConfig
from agents.demonstrations import DEMONSTRATION
from agents.engines.base import SamplingParams
from agents.rollout import EpisodeSummary, Seat, run_episode
from agents.store import Store
from agents.trajectory import BROKE_OFF, SessionStatus
from trainers.config import RolloutConfig
from trainers.progress import EpisodeRecord, Progress

logger = logging.getLogger(__name__)

MakeEnv = Callable[[], gym.Env[Any, Any]]

_IDLE_POLL_S = 0.25


def next_env(played: Mapping[str, int], weights: Mapping[str, float]) -> str:
    """The env whose share of the groups played so far lags its weight the most, so that
    over any stretch of the run each env plays about its weight's share. Deterministic (a
    resumed run goes on with the same schedule); ties go to the env listed first."""
    return min(weights, key=lambda name: (played.get(name, 0) + 1) / weights[name])


def worth_replaying(group: Sequence[EpisodeSummary], plays_before: int, limit: int) -> bool:
    """Whether a group's task is queued to be played again (`rollout.replay_informative`):
    every episode ended as the env decided (none broke off), they earned different rewards
    from the env (the policy solves it some of the time: a task at the edge of what the
    policy can do, where a new group most often has a learning signal again), and fewer than
    `limit` groups have replayed it (`plays_before`: the groups that played it before this
    one)."""
    if plays_before >= limit or any(s.status in BROKE_OFF for s in group):
        return False
    return len({s.total_reward for s in group}) > 1


class EnvPool:
    """Instances of one env, reused across episodes: a sandbox or a browser context is not
    rebuilt for every episode when the env can reset. An instance an episode broke off in
    is closed, not reused (it may be broken itself).

    Args:
        make: makes one instance.
    """

    def __init__(self, make: MakeEnv):
        self.make = make
        self._idle: list[gym.Env[Any, Any]] = []
        self._lock = threading.Lock()
        self.made = 0
        """Instances made so far (pooling keeps it at the most episodes ever in flight)."""

    def borrow(self) -> gym.Env[Any, Any]:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self.made += 1
        return self.make()

    def give_back(self, env: gym.Env[Any, Any], healthy: bool = True) -> None:
        if not healthy:
            env.close()
            return
        with self._lock:
            self._idle.append(env)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for env in idle:
            env.close()


class EnvSlot:
    """One env of the run: its config, its pool and its shuffled tasks.

    Args:
        name: the env's name in the run (`env.<name>`); its sessions' env id.
        config: the env's config.
        make: makes one instance.
    """

    def __init__(self, name: str, config: EnvConfig, make: MakeEnv):
        self.name, self.config, self.pool = name, config, EnvPool(make)
        self.task_ids: list[str] = []
        self.groups = 0
        """Groups started so far, replays included (their episodes' seeds follow it)."""
        self.fresh = 0
        """Fresh tasks started so far: the index in `task_ids` of the next one."""
        self.replays: collections.deque[tuple[str, int]] = collections.deque()
        """Tasks to play again (`rollout.replay_informative`), oldest first, each with how
        many groups have played it."""

    def next_task(self) -> tuple[str, int]:
        """The next group's task and how many groups played it before: a task queued for a
        replay first, else the next fresh one."""
        if self.replays:
            return self.replays.popleft()
        task_id = self.task_ids[self.fresh % len(self.task_ids)]
        self.fresh += 1
        return task_id, 0

    def load_tasks(self, seed: int) -> None:
        """Reads the env's task ids (shuffled by the run's seed)."""
        probe = self.pool.borrow()
        try:
            self.task_ids = list(probe.unwrapped.task_ids())  # type: ignore[attr-defined]
        finally:
            self.pool.give_back(probe)
        if not self.task_ids:
            raise ValueError(f"env.{self.name} ({self.config.id}) has no tasks to play")
        random.Random(f"{seed}:{self.name}").shuffle(self.task_ids)


def play_episode(
    pool: EnvPool,
    seat: Seat,
    env_name: str,
    task_id: str,
    group_id: str,
    seed: int,
    sampling: SamplingParams,
    session_id: str | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> tuple[EpisodeSummary, float]:
    """One episode on an instance borrowed from `pool`, and its wall time. An instance the
    episode failed in may be broken itself: it is closed, and the pool makes a fresh one."""
    env = pool.borrow()
    summary = None
    started = time.monotonic()
    try:
        summary = run_episode(
            env,
            seat,
            env_id=env_name,
            task_id=task_id,
            seed=seed,
            group_id=group_id,
            sampling=sampling,
            session_id=session_id,
            metadata=metadata,
        )
        return summary, time.monotonic() - started
    finally:
        healthy = summary is not None and summary.status not in BROKE_OFF
        pool.give_back(env, healthy=healthy)


class EpisodePlayer(Protocol):
    """Where a rollout's episodes are played."""

    def play(
        self, slot: EnvSlot, task_id: str, group_id: str, seed: int, sampling: SamplingParams
    ) -> tuple[EpisodeSummary, float]:
        """Plays one episode of `slot`'s env; its summary and wall time."""
        ...

    def close(self) -> None:
        """Frees what the player holds (env instances, workers)."""
        ...


class LocalPlayer:
    """Episodes played in this process, on each slot's pool, through `seat`."""

    def __init__(self, seat: Seat):
        self.seat = seat

    def play(
        self, slot: EnvSlot, task_id: str, group_id: str, seed: int, sampling: SamplingParams
    ) -> tuple[EpisodeSummary, float]:
        return play_episode(slot.pool, self.seat, slot.name, task_id, group_id, seed, sampling)

    def close(self) -> None:
        pass


class RolloutLoop:
    """Plays task groups of a mixture's envs, `groups_in_flight` at a time.

    Args:
        config: the rollout's config.
        slots: the envs that roll out, by name.
        player: where the episodes are played (and reach the policy).
        sampling: the run's sampling (each env may set its own `max_tokens`).
        seed: the run's seed (tasks' order, episodes' seeds).
        progress: where finished episodes are counted.
        has_room: whether the backlog has room for more turns (else the loop waits).
    """

    def __init__(
        self,
        config: RolloutConfig,
        slots: Mapping[str, EnvSlot],
        player: EpisodePlayer,
        sampling: SamplingConfig,
        seed: int,
        progress: Progress,
        has_room: Callable[[], bool],
    ):
        self.config, self.slots, self.player = config, dict(slots), player
        self.sampling, self.seed, self.progress, self.has_room = sampling, seed, progress, has_room
        self._lock = threading.Lock()
        self._empty_in_a_row = 0

    def start(self, store: Store) -> None:
        """Loads each env's tasks and, on a resumed run, skips the groups it played, so
        that the run goes on with new tasks and seeds."""
        played: dict[str, int] = {}
        for session in store.sessions():
            if DEMONSTRATION not in session.metadata:  # a warm start's, not a rollout
                played[session.env_id] = played.get(session.env_id, 0) + 1
        for slot in self.slots.values():
            slot.load_tasks(self.seed)
            slot.groups = played.get(slot.name, 0) // slot.config.group_size
            # past every task the stopped run started, replays counted as fresh ones: a few
            # fresh tasks go unplayed, and the replays it had queued are not played
            slot.fresh = slot.groups

    def run(self, stop: threading.Event) -> None:
        """Plays groups until `stop` is set; the first error of any worker stops the
        others and is raised."""
        errors: list[BaseException] = []

        def worker() -> None:
            try:
                while not stop.is_set():
                    if not self.has_room():
                        time.sleep(_IDLE_POLL_S)
                        continue
                    self.play_group()
            except BaseException as error:
                errors.append(error)
                stop.set()

        with ThreadPoolExecutor(self.config.groups_in_flight, "rollout") as pool:
            for _ in range(self.config.groups_in_flight):
                pool.submit(worker)
        if errors:
            raise errors[0]

    def play_groups(self) -> list[EpisodeSummary]:
        """`groups_in_flight` groups played concurrently, then returns (the alternating
        pipeline's rollout phase: a batching engine decodes all their turns together)."""
        count = self.config.groups_in_flight
        with ThreadPoolExecutor(count, "rollout") as pool:
            groups = list(pool.map(lambda _: self.play_group(), range(count)))
        return [summary for group in groups for summary in group]

    def play_group(self) -> list[EpisodeSummary]:
        """The next group (of the env the schedule picks), its episodes played concurrently."""
        with self._lock:
            weights = {name: slot.config.weight for name, slot in self.slots.items()}
            slot = self.slots[next_env({n: s.groups for n, s in self.slots.items()}, weights)]
            number = slot.groups
            slot.groups += 1
            task_id, plays = slot.next_task()
        size = slot.config.group_size
        group_id = f"{slot.name}:{task_id}#{uuid.uuid4().hex[:8]}"
        seeds = [self.seed * 100_003 + number * size + i for i in range(size)]
        with ThreadPoolExecutor(size, f"group-{slot.name}") as pool:
            played = list(pool.map(lambda s: self._episode(slot, task_id, group_id, s), seeds))
        for result, wall_s in played:
            self._count(slot.name, result, wall_s, replay=plays > 0)
        summaries = [result for result, _ in played]
        if worth_replaying(summaries, plays, self.config.replay_informative):
            with self._lock:
                slot.replays.append((task_id, plays + 1))
        return summaries

    def _episode(
        self, slot: EnvSlot, task_id: str, group_id: str, seed: int
    ) -> tuple[EpisodeSummary, float]:
        """One episode (the env's own turn budget, if it sets one) and its wall time."""
        sampling = sampling_params(self.sampling, seed)
        if slot.config.max_tokens is not None:
            sampling = dataclasses.replace(sampling, max_tokens=slot.config.max_tokens)
        return self.player.play(slot, task_id, group_id, seed, sampling)

    def _count(self, env: str, result: EpisodeSummary, wall_s: float, replay: bool) -> None:
        """Records a finished episode; a run of `max_empty_episodes` in a row that gave
        nothing to train on (none played a turn, or their server failed) stops the loop."""
        empty = result.turns == 0 or result.status == SessionStatus.INTERRUPTED
        with self._lock:
            self._empty_in_a_row = self._empty_in_a_row + 1 if empty else 0
            if self._empty_in_a_row >= self.config.max_empty_episodes:
                raise RuntimeError(
                    f"{self._empty_in_a_row} episodes in a row gave nothing to train on "
                    f"(no turn played, or the policy's server failed); the last ({env}): "
                    f"{result.error}"
                )
        self.progress.record(
            env,
            EpisodeRecord(
                reward=result.total_reward,
                turns=result.turns,
                completion_tokens=result.completion_tokens,
                wall_s=round(wall_s, 3),
                status=str(result.status),
                reason=result.error,
                replay=replay,
            ),
        )
