"""Rollouts on a Ray cluster (`cluster=ray`): rollout workers, each a Ray actor holding a
pool of env instances, play the run's episodes against the proxy's URL.

    python -m trainers.run cluster=ray env=[arith,terminal]          # a Ray of this machine
    RAY_ADDRESS=10.0.0.5:6379 python -m trainers.run cluster=ray cluster.workers=32 \\
        serve.host=0.0.0.0 serve.api_key=KEY cluster.proxy_host=10.0.0.5 env=[terminal,swe]

A worker reaches the policy exactly as a live client does: over HTTP with the official
`openai` client and the session headers (`agents.rollout.ProxySeat`), so the proxy stays the
one writer of turns and the store, the learner and resume are the same as in process. Each
worker records itself in its sessions' metadata (`worker_node`, `worker_pid`).

The trainer names each episode's session before handing it out. A worker that dies
mid-episode (its process killed, its node lost) fails the call with a `RayActorError`: the
trainer ends that session failed with the reason through its own seat, and Ray restarts the
actor (`max_restarts=-1`) wherever there is room, so the run goes on; a request the dead
worker had in flight finishes in the proxy and is stored with the failed session, never
trained twice nor lost.

What scales how: env instances (sandboxes, browsers) and the agent loops scale with
workers and nodes; sampling scales with the engine (vLLM batches every worker's requests);
the learner and the proxy stay one process each. `benchmarks/perf/scale.py` measures it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import ray
from ray.exceptions import RayActorError

from agents.compose import env_factory
from agents.config import EnvConfig
from agents.engines.base import SamplingParams
from agents.rollout import EpisodeSummary, ProxySeat, Seat
from agents.trajectory import SessionStatus
from trainers.config import ClusterConfig
from trainers.rollouts import EnvPool, EnvSlot, play_episode

logger = logging.getLogger(__name__)

FORWARDED_PREFIXES = ("CLAWGYM_", "HF_")
"""Environment variables of the trainer that its workers get too (model and task caches,
offline switches): a worker on another node starts from its own environment."""


class RolloutWorker:
    """A Ray actor's body: pools of the run's envs, and a seat at the proxy.

    Args:
        envs: the run's simulated envs by name.
        base_url: the proxy's OpenAI-compatible base URL, as this worker's node reaches it.
        api_key: the proxy's API key, if it has one.
        admin_key: the proxy's admin key (the episode routes).
    """

    def __init__(
        self, envs: Mapping[str, EnvConfig], base_url: str, api_key: str | None, admin_key: str
    ):
        self.pools = {name: EnvPool(env_factory(config)) for name, config in envs.items()}
        self.seat = ProxySeat(base_url, api_key, admin_key=admin_key)
        self.identity = {
            "worker_node": ray.get_runtime_context().get_node_id(),
            "worker_pid": os.getpid(),
        }

    def where(self) -> dict[str, Any]:
        """The node and process this worker runs in."""
        return dict(self.identity)

    def play(
        self,
        env_name: str,
        task_id: str,
        group_id: str,
        seed: int,
        sampling: SamplingParams,
        session_id: str,
    ) -> tuple[EpisodeSummary, float]:
        """One episode of `env_name` in session `session_id`; its summary and wall time."""
        pool = self.pools[env_name]
        return play_episode(
            pool, self.seat, env_name, task_id, group_id, seed, sampling, session_id, self.identity
        )

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.seat.close()


class RayPlayer:
    """Hands episodes to rollout workers, the least busy first (`trainers.rollouts`'
    `EpisodePlayer`).

    Args:
        cluster: the cluster's config.
        envs: the run's simulated envs by name.
        base_url: the proxy's base URL as workers reach it.
        api_key: the proxy's API key, if any.
        admin_key: the proxy's admin key.
        seat: the trainer's own seat at the proxy, which ends the sessions of a worker that
            died mid-episode.
    """

    def __init__(
        self,
        cluster: ClusterConfig,
        envs: Mapping[str, EnvConfig],
        base_url: str,
        api_key: str | None,
        admin_key: str,
        seat: Seat,
    ):
        self.seat = seat
        actor = ray.remote(RolloutWorker).options(
            num_cpus=cluster.worker_cpus,
            max_restarts=-1,
            max_task_retries=0,  # an episode is never replayed: it was stored as it went
            max_concurrency=1024,  # as many episodes at once as the trainer hands it
            scheduling_strategy="SPREAD" if cluster.spread else "DEFAULT",
        )
        # Ray's actor handles are typed as the class they wrap, which has no `.remote`
        self.workers: list[Any] = [
            actor.remote(dict(envs), base_url, api_key, admin_key) for _ in range(cluster.workers)
        ]
        self._busy = [0] * len(self.workers)
        self._lock = threading.Lock()
        self.where = ray.get([worker.where.remote() for worker in self.workers])
        """Each worker's node and pid at start."""
        nodes = {w["worker_node"] for w in self.where}
        logger.info("%d rollout workers on %d Ray nodes", len(self.workers), len(nodes))

    def play(
        self, slot: EnvSlot, task_id: str, group_id: str, seed: int, sampling: SamplingParams
    ) -> tuple[EpisodeSummary, float]:
        with self._lock:
            index = min(range(len(self.workers)), key=self._busy.__getitem__)
            self._busy[index] += 1
        session_id = uuid.uuid4().hex
        started = time.monotonic()
        try:
            call = self.workers[index].play.remote(
                slot.name, task_id, group_id, seed, sampling, session_id
            )
            summary, wall_s = ray.get(call)
            return summary, wall_s
        except RayActorError as error:
            reason = f"the rollout worker died mid-episode: {_first_line(error)}"
            logger.warning("episode %s of %s: %s", session_id, slot.name, reason)
            self._end_failed(session_id, reason)
            failed = EpisodeSummary(
                session_id, task_id, 0.0, 0, 0, 0, False, SessionStatus.FAILED, error=reason
            )
            return failed, time.monotonic() - started
        finally:
            with self._lock:
                self._busy[index] -= 1

    def _end_failed(self, session_id: str, reason: str) -> None:
        """Ends a dead worker's session failed; one it never opened stays unrecorded."""
        try:
            self.seat.end(session_id, [], {}, 0.0, SessionStatus.FAILED, reason)
        except RuntimeError as error:  # not opened (404), or ended already (409)
            logger.info("session %s of a dead worker: %s", session_id, error)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a worker that is gone has nothing to free
            ray.get([worker.close.remote() for worker in self.workers], timeout=60)
        for worker in self.workers:
            ray.kill(worker)


@contextlib.contextmanager
def ray_cluster(cluster: ClusterConfig) -> Iterator[None]:
    """Connected to the Ray cluster at `cluster.address` (else $RAY_ADDRESS), or to a Ray
    started on this machine for the run; disconnected (and that Ray stopped) at the end."""
    address = cluster.address or os.environ.get("RAY_ADDRESS") or None
    forwarded = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)}
    options: dict[str, Any] = {
        "include_dashboard": False,
        "logging_level": logging.WARNING,
        "runtime_env": {"env_vars": forwarded},
    }
    if address is None:
        # Ray's CPUs are reservations: the workers must fit whatever this machine has
        needed = cluster.workers * cluster.worker_cpus
        options["num_cpus"] = max(needed, float(os.cpu_count() or 1))
    # "local": a new Ray, never the one a stale /tmp/ray/ray_current_cluster names
    ray.init(address=address or "local", **options)
    logger.info("Ray: %s", address or "started on this machine")
    try:
        yield
    finally:
        ray.shutdown()


def worker_url(url: str, cluster: ClusterConfig) -> str:
    """The proxy's base URL as the workers reach it: `cluster.proxy_host` where set, this
    node's address on the cluster where the proxy listens on every interface."""
    parts = urlsplit(url)
    host = cluster.proxy_host
    if host is None and parts.hostname in ("0.0.0.0", "::"):
        host = ray.util.get_node_ip_address()
    if host is None:
        return url
    return urlunsplit(parts._replace(netloc=f"{host}:{parts.port}"))


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
