"""Rollouts on a Ray cluster (`cluster=ray`): rollout workers, each a Ray actor holding a
pool of env instances, play the run's episodes against the proxy's URL; and, with
`cluster.replicas`, vLLM replicas as Ray actors serve the policy behind the proxy.

    python -m trainers.run cluster=ray env=[arith,terminal]          # a Ray of this machine
    RAY_ADDRESS=10.0.0.5:6379 python -m trainers.run cluster=ray cluster.workers=32 \\
        serve.host=0.0.0.0 serve.api_key=KEY cluster.proxy_host=10.0.0.5 env=[terminal,swe]

A worker reaches the policy exactly as a live client does: over HTTP with the official
`openai` client and the session headers (`agents.seats.ProxySeat`), so the proxy stays the
one writer of turns and the store, the learner and resume are the same as in process. Each
worker records itself in its sessions' metadata (`worker_node`, `worker_pid`).

The trainer names each episode's session before handing it out. A worker that dies
mid-episode (its process killed, its node lost) fails the call with a `RayActorError`: the
trainer ends that session failed with the reason through its own seat, and Ray restarts the
actor (`max_restarts=-1`) wherever there is room, so the run goes on; a request the dead
worker had in flight finishes in the proxy and is stored with the failed session, never
trained twice nor lost.

Replicas (`VLLMReplica`): each actor starts a vLLM server on its node (bound to its own
cores on a CPU node, to the GPUs Ray gives it on a GPU node; on the trainer's node it
listens on loopback, elsewhere on the node's address with an API key of its own). The
trainer talks to it over HTTP through a `VLLMEngine.attached` client, which keeps the
versions and in-flight counts as for a server of its own; each adapter version's files are
sent to the actor, which writes them where its server reads them. The proxy routes each
session to one replica (`agents.engines.replicas.ReplicaSet`); a replica that dies is
replaced by a new actor that loads the newest adapter, and its sessions move meanwhile.

What scales how: env instances (sandboxes, browsers) and the agent loops scale with
workers and nodes; sampling scales with replicas (each batches its sessions' requests);
the learner and the proxy stay one process each. `benchmarks/perf/scale.py` measures it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from agents.compose import build_engine, cuda_available, env_factory
from agents.config import EngineConfig, EnvConfig, ModelConfig
from agents.engines.base import SamplingParams
from agents.engines.replicas import ReplicaSet
from agents.engines.vllm import VLLMEngine
from agents.engines.vllm_command import own_cpus
from agents.engines.vllm_server import EngineDied
from agents.rollout import EpisodeSummary, Seat
from agents.seats import ProxySeat
from agents.trajectory import SessionStatus
from trainers.compute_config import ClusterConfig
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
        self.where = placed(
            [worker.where.remote() for worker in self.workers],
            f"{cluster.workers} rollout workers of {cluster.worker_cpus:g} CPUs",
            cluster.place_timeout_s,
        )
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
                session_id, task_id, 0.0, 0, 0, 0, False, SessionStatus.INTERRUPTED, error=reason
            )
            return failed, time.monotonic() - started
        finally:
            with self._lock:
                self._busy[index] -= 1

    def _end_failed(self, session_id: str, reason: str) -> None:
        """Ends a dead worker's session failed; one it never opened stays unrecorded."""
        try:
            self.seat.end(session_id, [], {}, 0.0, SessionStatus.INTERRUPTED, reason)
        except RuntimeError as error:  # not opened (404), or ended already (409)
            logger.info("session %s of a dead worker: %s", session_id, error)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a worker that is gone has nothing to free
            ray.get([worker.close.remote() for worker in self.workers], timeout=60)
        for worker in self.workers:
            ray.kill(worker)


class VLLMReplica:
    """A Ray actor's body: a vLLM server on the actor's node (see the module docstring).

    Args:
        engine, model: the run's engine and model configs.
        index: the replica's number (on a CPU node, which of its cores it takes).
        trainer_node: the Ray node the trainer runs on.
        cores: cores it computes on, on a CPU node.
    """

    def __init__(
        self, engine: EngineConfig, model: ModelConfig, index: int, trainer_node: str, cores: int
    ):
        self.node = ray.get_runtime_context().get_node_id()
        local = self.node == trainer_node
        self.api_key = None if local else secrets.token_urlsafe(24)
        host = "127.0.0.1" if local else ray.util.get_node_ip_address()
        cpus = None
        if not cuda_available():
            mine = own_cpus()
            first = (index * cores) % len(mine)
            cpus = mine[first : first + cores] or mine
        built = build_engine(engine, model, cpus=cpus, host=host, api_key=self.api_key)
        if not isinstance(built, VLLMEngine):
            built.close()
            raise ValueError("cluster.replicas are vLLM servers: add engine=vllm")
        self.engine: VLLMEngine = built
        self.adapters = Path(tempfile.mkdtemp(prefix="clawgym-replica-"))

    def describe(self) -> dict[str, Any]:
        """Where its server is and how to reach it."""
        engine = self.engine
        return {
            "base_url": engine.base_url,
            "api_key": self.api_key,
            "pid": engine.pid,
            "log": str(engine.log_path),
            "node": self.node,
        }

    def alive(self) -> bool:
        return self.engine.server.alive()

    def healthy(self, timeout: float) -> bool:
        return self.engine.server.healthy(timeout)

    def death(self, wait: float) -> str | None:
        """Why its server died, or None while it lives."""
        died = self.engine.server.death(wait)
        return None if died is None else str(died)

    def stage(self, version: int, files: dict[str, bytes]) -> str:
        """Writes an adapter's files on this node; the directory its server loads."""
        target = self.adapters / f"v{version}"
        target.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (target / name).write_bytes(data)
        return str(target)

    def close(self) -> None:
        self.engine.close()


class RayServer:
    """The `ServerHandle` of a replica's server, asked through its actor: a dead actor (its
    process or node gone) is a dead server."""

    def __init__(self, actor: Any, described: Mapping[str, Any]):
        self.actor, self.described = actor, dict(described)

    @property
    def pid(self) -> int:
        return int(self.described["pid"])

    @property
    def log_path(self) -> Path:
        return Path(self.described["log"])  # on the replica's node

    def alive(self) -> bool:
        try:
            return bool(ray.get(self.actor.alive.remote(), timeout=30))
        except RayError:
            return False

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            return bool(ray.get(self.actor.healthy.remote(timeout), timeout=timeout + 30))
        except RayError:
            return False

    def death(self, wait: float = 0.0) -> EngineDied | None:
        try:
            reason = ray.get(self.actor.death.remote(wait), timeout=wait + 30)
        except GetTimeoutError:
            return None
        except RayError as error:
            where = f"node {self.described['node'][:12]}"
            return EngineDied(f"the vLLM replica on {where} is gone: {_first_line(error)}")
        return None if reason is None else EngineDied(reason)

    def stop(self, grace: float = 10.0) -> None:
        with contextlib.suppress(RayError):
            ray.get(self.actor.close.remote(), timeout=grace + 30)
        with contextlib.suppress(RayError):
            ray.kill(self.actor)


def ray_replicas(cluster: ClusterConfig, engine: EngineConfig, model: ModelConfig) -> ReplicaSet:
    """`cluster.replicas` vLLM replicas as Ray actors behind one `ReplicaSet`, each dead one
    replaced by a new actor; waits until every server answers."""
    actor = ray.remote(VLLMReplica).options(
        num_cpus=cluster.replica_cpus,
        num_gpus=cluster.replica_gpus,
        max_restarts=0,  # the set replaces a dead replica itself: a new one gets the adapter
        scheduling_strategy="SPREAD",
    )
    trainer_node = ray.get_runtime_context().get_node_id()
    cores = max(1, int(cluster.replica_cpus))

    def launch(index: int) -> Any:
        return actor.remote(engine, model, index, trainer_node, cores)

    def attach(handle: Any) -> VLLMEngine:
        described = placed(  # once its server answers
            handle.describe.remote(),
            f"a vLLM replica of {cluster.replica_cpus:g} CPUs and {cluster.replica_gpus:g} GPUs",
            cluster.place_timeout_s + engine.startup_timeout,
        )

        def stage(path: str, version: int) -> str:
            files = {f.name: f.read_bytes() for f in Path(path).iterdir() if f.is_file()}
            return str(ray.get(handle.stage.remote(version, files)))

        server = RayServer(handle, described)
        return VLLMEngine.attached(
            model.name, server, described["base_url"], described["api_key"], stage
        )

    handles = [launch(index) for index in range(cluster.replicas)]  # they start together
    engines: list[VLLMEngine] = []
    try:
        for handle in handles:
            engines.append(attach(handle))
    except BaseException:
        for started in engines:
            started.close()
        for handle in handles:
            with contextlib.suppress(RayError):
                ray.kill(handle)
        raise
    logger.info("%d vLLM replicas on Ray", len(engines))
    return ReplicaSet(engines, replace=lambda index: attach(launch(index)))


def placed(refs: Any, what: str, timeout: float) -> Any:
    """`ray.get(refs)` of actors' first calls, which answer once Ray has placed them; past
    `timeout` an error naming what was asked for and what the cluster has."""
    try:
        return ray.get(refs, timeout=timeout)
    except GetTimeoutError:
        raise RuntimeError(
            f"{what} found no place on the Ray cluster within {timeout:g} s: it has "
            f"{ray.cluster_resources()}, of which {ray.available_resources()} free; ask for "
            "less (cluster.workers, cluster.worker_cpus, cluster.replicas, "
            "cluster.replica_cpus/gpus) or add nodes"
        ) from None


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
        # Ray's CPUs are reservations: the workers and replicas must fit whatever this
        # machine has, or they would wait for a place forever
        needed = cluster.workers * cluster.worker_cpus + cluster.replicas * cluster.replica_cpus
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
