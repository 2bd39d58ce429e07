"""`cluster=ray`: rollout workers on a real two-node Ray cluster of this machine (a head and
a second node, each its own `ray start`, addressed on loopback) play a mixture's episodes
through the trainer's proxy; a worker killed mid-episode leaves that episode failed with its
reason, and the run goes on to its last step.

Ray resolves a loopback node address to the machine's own and listens on every interface;
its token authentication (on by default for clusters since Ray 2.59, `RAY_AUTH_MODE=token`
for clients) keeps the nodes to this machine's processes: the token is made here for the
test and handed to the nodes, the probes and the run in their environment (a fresh machine
has no ~/.ray/auth_token)."""

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agents.config import EnvConfig
from agents.store import Store
from agents.trajectory import SessionStatus, TurnStatus
from tests.trainers.test_run import ROOT, TEST_DEFAULTS, TINY
from trainers.compute_config import ClusterConfig
from trainers.config import RunConfig, validate

RAY = Path(sys.executable).with_name("ray")
AUTH = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ray_node(log: Path, *arguments: str) -> subprocess.Popen[bytes]:
    """A Ray node in the foreground (`--block`), in a process group of its own, its output
    in `log`."""
    command = [str(RAY), "start", "--block", "--num-cpus=1", "--node-ip-address=127.0.0.1"]
    command += ["--disable-usage-stats", *arguments]
    with open(log, "wb") as output:
        return subprocess.Popen(
            command, env=AUTH, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )


def _alive_nodes(address: str) -> int:
    probe = (
        f"import ray; ray.init(address={address!r}, logging_level='ERROR'); "
        "print(sum(n['Alive'] for n in ray.nodes()))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], env=AUTH, capture_output=True, text=True, timeout=120
    )
    return int(result.stdout.split()[-1]) if result.returncode == 0 else 0


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A head and a second node, 1 CPU each, on loopback; its address."""
    logs = tmp_path_factory.mktemp("ray-nodes")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    head = _ray_node(logs / "head.log", "--head", f"--port={port}", "--include-dashboard=false")
    nodes = [head]
    try:
        deadline = time.monotonic() + 120
        while _alive_nodes(address) < 1:
            started = head.poll() is None and time.monotonic() < deadline
            assert started, "the head did not start: " + (logs / "head.log").read_text()[-2000:]
        nodes.append(_ray_node(logs / "node.log", f"--address={address}"))
        while _alive_nodes(address) < 2:
            assert time.monotonic() < deadline, "the second node did not join"
            time.sleep(1)
        yield address
    finally:
        for node in reversed(nodes):
            with contextlib.suppress(ProcessLookupError):  # a node that failed has exited
                os.killpg(node.pid, signal.SIGTERM)
        for node in nodes:
            try:
                node.wait(timeout=5)
            except subprocess.TimeoutExpired:  # Ray's orderly stop takes 30 s: nothing to keep
                os.killpg(node.pid, signal.SIGKILL)
                node.wait(timeout=30)


def _open_episode_with_a_turn(store_path: Path) -> tuple[str, int] | None:
    """(session id, worker pid) of an episode in flight past its first turn."""
    if not store_path.exists():
        return None
    with Store(store_path) as store:
        for session in store.sessions(SessionStatus.OPEN):
            if "worker_pid" in session.metadata and store.session(session.session_id).turns:
                return session.session_id, int(session.metadata["worker_pid"])
    return None


@pytest.mark.slow
def test_workers_on_two_nodes_play_a_mixture_and_a_killed_worker_interrupts_only_its_episode(
    tmp_path, two_nodes
):
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "trainers.run",
        *TINY,
        *TEST_DEFAULTS,
        "env=[arith,terminal]",
        "env.arith.group_size=2",
        "env.arith.max_tokens=16",
        "env.terminal.group_size=2",
        "env.terminal.max_tokens=16",
        "env.terminal.kwargs.max_turns=4",
        "env.terminal.kwargs.sandbox=bwrap",
        "trainer.batch_turns=4",
        "trainer.max_steps=3",
        "cluster=ray",
        f"cluster.address={two_nodes}",
        f"run_dir={run_dir}",
    ]
    trainer = subprocess.Popen(
        command, cwd=ROOT, env=AUTH, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 600
        victim = None
        while victim is None:
            assert trainer.poll() is None, trainer.stderr.read()[-3000:] if trainer.stderr else ""
            assert time.monotonic() < deadline, "no episode was ever seen in flight"
            victim = _open_episode_with_a_turn(run_dir / "store.sqlite")
            time.sleep(0.05)
        session_id, pid = victim
        os.kill(pid, signal.SIGKILL)
        _, stderr = trainer.communicate(timeout=900)
        assert trainer.returncode == 0, stderr[-4000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    with Store(run_dir / "store.sqlite") as store:
        killed = store.session(session_id)
        sessions = [store.session(s.session_id) for s in store.sessions()]
    assert killed.status == SessionStatus.INTERRUPTED and killed.turns
    assert "rollout worker died" in killed.metadata["end_reason"]
    # no fault of the policy's: its turns are kept, never trained on
    assert {t.status for t in killed.turns} == {TurnStatus.DROPPED}
    played = [s for s in sessions if s.turns and "worker_node" in s.metadata]
    assert {s.env_id for s in played} == {"arith", "terminal"}
    assert len({s.metadata["worker_node"] for s in played}) == 2  # turns from both nodes
    # the restarted worker played on: episodes by a pid other than the killed one ended later
    later = [s for s in played if s.created_at > killed.created_at and s.status == "done"]
    assert later and all(s.metadata["worker_pid"] != pid for s in later)


def test_workers_that_the_cluster_cannot_place_stop_the_run_naming_the_resources(
    tmp_path, two_nodes
):
    command = [
        sys.executable,
        "-m",
        "trainers.run",
        *TINY,
        *TEST_DEFAULTS,
        "env=[arith]",
        "trainer.max_steps=1",
        "cluster=ray",
        f"cluster.address={two_nodes}",
        "cluster.worker_cpus=2",  # each node has 1
        "cluster.place_timeout_s=5",
        f"run_dir={tmp_path / 'run'}",
    ]
    result = subprocess.run(
        command, cwd=ROOT, env=AUTH, capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0
    assert "2 rollout workers of 2 CPUs found no place on the Ray cluster within 5 s" in (
        result.stderr
    )


def test_the_default_cluster_trains_in_process_without_importing_ray():
    probe = (
        "import sys; import trainers.run, trainers.rollouts, trainers.pipeline; "
        "print('ray' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("cluster", "fragment"),
    [
        (ClusterConfig(kind="slurm"), "cluster=local or cluster=ray"),
        (ClusterConfig(kind="ray", workers=0), "cluster.workers"),
        (ClusterConfig(kind="ray", worker_cpus=0), "cluster.worker_cpus"),
        (ClusterConfig(kind="ray", place_timeout_s=0), "cluster.place_timeout_s"),
        (ClusterConfig(kind="ray", replicas=2), "engine=vllm"),
        (ClusterConfig(kind="local", replicas=2), "cluster=ray"),
    ],
)
def test_a_cluster_config_that_cannot_run_says_the_fix(cluster, fragment):
    config = RunConfig(env={"arith": EnvConfig(id="clawgym/Arith-v0")}, cluster=cluster)
    with pytest.raises(ValueError, match=fragment):
        validate(config)


def test_workers_reach_the_proxy_where_the_cluster_says():
    from trainers.cluster import worker_url

    url = "http://127.0.0.1:4000/v1"
    assert worker_url(url, ClusterConfig(kind="ray")) == url
    moved = worker_url(url, ClusterConfig(kind="ray", proxy_host="10.0.0.5"))
    assert moved == "http://10.0.0.5:4000/v1"


@pytest.mark.slow
@pytest.mark.vllm
def test_two_vllm_replicas_on_ray_serve_a_run_and_take_every_adapter(tmp_path):
    """Two vLLM replicas as Ray actors (a Ray started for the run), each bound to its own
    core, serve the run's sessions; every version reaches both (the learner's log-probs
    match what the replicas sampled at versions 1 and 2)."""
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "trainers.run",
        *TINY,
        *TEST_DEFAULTS,
        "env=[arith]",
        "env.arith.group_size=2",
        "env.arith.max_tokens=16",
        "engine=vllm",
        "engine.max_lora_rank=8",
        "method=binary",
        "trainer.max_steps=2",
        "cluster=ray",
        "cluster.replicas=2",
        "cluster.workers=1",
        f"run_dir={run_dir}",
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "2 vLLM replicas on Ray" in (run_dir / "run.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["engine"], summary["steps"], summary["adapter_version"]) == ("vllm", 2, 2)
    assert summary["logprob_gap_max"] is not None and summary["logprob_gap_max"] < 1e-3
