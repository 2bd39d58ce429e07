"""Where a run computes, beside the learning configs of `trainers.config`: its rollout
workers and vLLM replicas (`cluster=`, trainers/cluster.py) and its LoRA steps and sampling
(`backend=`, trainers/tinker_learner.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ClusterConfig:
    """Where rollouts run (`cluster=`, trainers/cluster.py): in the trainer's process, or
    on a Ray cluster. The learner and the store stay in the trainer's process either way,
    and the proxy stays the one writer of turns."""

    kind: str = "local"
    """local: episodes play on threads of the trainer's process (Ray is not imported);
    ray: on rollout workers, Ray actors each holding a pool of env instances."""
    address: str | None = None
    """ray: the cluster to join (`HOST:PORT` of its head); None: $RAY_ADDRESS, else a Ray
    started on this machine for the run (and stopped with it)."""
    workers: int = 2
    """ray: rollout workers."""
    worker_cpus: float = 1.0
    """ray: CPUs each worker reserves (its sandboxes and browsers run on its node)."""
    spread: bool = True
    """ray: place workers on as many nodes as there are (Ray's SPREAD), rather than packed."""
    proxy_host: str | None = None
    """ray: the address workers reach the proxy at, where it is not the one the proxy binds
    (a proxy on 0.0.0.0: this node's address on the cluster's network)."""
    replicas: int = 0
    """ray with engine=vllm: vLLM replicas as Ray actors behind the proxy, routed by session
    (`agents.engines.replicas`); 0: the engine runs beside the trainer as `engine=` says."""
    replica_cpus: float = 1.0
    """ray: CPUs each replica reserves (on a CPU node, the cores its threads are bound to)."""
    replica_gpus: float = 0.0
    """ray: GPUs each replica reserves (1: a GPU of its own; 0.5: half of one, with
    `engine.gpu_memory_utilization` at most 0.5)."""
    place_timeout_s: float = 600.0
    """ray: seconds the workers and replicas may wait for a place on the cluster (a replica
    then has `engine.startup_timeout` more to answer); past it the run stops, naming what it
    asked for and what the cluster has, rather than wait for resources that never come."""


def validate_cluster(cluster: ClusterConfig) -> None:
    """Raises ValueError, saying the fix, for a cluster the run cannot use."""
    if cluster.kind not in ("local", "ray"):
        raise ValueError(f"cluster={cluster.kind!r}: choose cluster=local or cluster=ray")
    if cluster.workers < 1 or cluster.worker_cpus <= 0:
        raise ValueError(
            f"cluster.workers must be >= 1 and cluster.worker_cpus > 0, got "
            f"{cluster.workers} and {cluster.worker_cpus}"
        )
    if cluster.place_timeout_s <= 0:
        raise ValueError(f"cluster.place_timeout_s must be > 0, got {cluster.place_timeout_s}")
    if cluster.replicas < 0 or cluster.replica_cpus <= 0 or cluster.replica_gpus < 0:
        raise ValueError(
            "cluster.replicas must be >= 0, cluster.replica_cpus > 0 and cluster.replica_gpus >= 0"
        )
    if cluster.replicas and cluster.kind != "ray":
        raise ValueError("cluster.replicas places vLLM replicas on Ray: add cluster=ray")


@dataclass
class BackendConfig:
    """Where the LoRA steps, sampling and teacher log-probs run (`backend=`): this process's
    learner and `engine=`, or a Tinker service (`trainers.tinker_learner`,
    `agents.engines.tinker`); the proxy, store, judges and methods are the same either way."""

    kind: str = "local"
    """local: the peft learner here and the configured engine; tinker: a Tinker service."""
    base_url: str | None = None
    """tinker: the service's address; None: $TINKER_BASE_URL (unset: Tinker's own cloud)."""
    api_key: str | None = None
    """tinker: its API key; None: $TINKER_API_KEY (kept out of the config written to the run)."""
    base_model: str | None = None
    """tinker: the service's name of the base model; None: `model.name`."""
    context_length: int | None = None
    """tinker: the longest prompt plus completion sampled; None: `engine.context_length`,
    else the model's `max_position_embeddings`."""
