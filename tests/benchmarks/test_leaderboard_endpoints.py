"""The leaderboard's `openai:` and `vllm:` policies end to end, from the command line: a policy
served elsewhere (clawgym's own proxy, started here on loopback) and a base model on a vLLM
server the leaderboard starts itself."""

import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited: {server.stderr.read()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer within {timeout_s} s")


def leaderboard(out: Path, policy: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "benchmarks.run",
        "suite=arith/test",
        "limit=2",
        "baselines=[]",
        "sampling.max_tokens=8",
        f"policy={policy}",
        f"out_dir={out}",
    ]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)


def results(out: Path) -> list[tuple]:
    with sqlite3.connect(out / "results.sqlite") as db:
        return db.execute("SELECT policy, episodes, errors, tokens_out FROM results").fetchall()


def test_an_openai_policy_plays_against_an_endpoint_served_elsewhere(tmp_path):
    """`openai:policy@URL` against `python -m agents.serve` on loopback: every episode reaches
    the endpoint (its store records the turns) and the board ranks the policy."""
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agents.serve",
            "model=tiny",
            f"serve.port={port}",
            f"store={tmp_path / 'served.sqlite'}",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/healthz", server)
        out, spec = tmp_path / "board", f"openai:policy@http://127.0.0.1:{port}/v1"
        done = leaderboard(out, spec)
        assert done.returncode == 0, done.stderr[-4000:]
    finally:
        server.terminate()
        server.wait(timeout=60)
    ((policy, episodes, errors, tokens_out),) = results(out)
    assert (policy, episodes, errors) == (spec, 2, 0)
    assert tokens_out > 0
    with sqlite3.connect(tmp_path / "served.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM turns").fetchone()[0] >= 2
    assert spec in (out / "leaderboard.md").read_text()


@pytest.mark.slow
@pytest.mark.vllm
def test_a_vllm_policy_plays_on_a_server_the_leaderboard_starts(tmp_path):
    out = tmp_path / "board"
    done = leaderboard(out, "vllm:tiny")
    assert done.returncode == 0, done.stderr[-4000:]
    ((policy, episodes, errors, tokens_out),) = results(out)
    assert (policy, episodes, errors) == ("vllm:tiny", 2, 0)
    assert tokens_out > 0
