"""`trainers.run backend=tinker` against clawgym's own Tinker server (a subprocess on a
loopback port), with the real `tinker` SDK: sampling, teacher log-probs and LoRA steps all
go through the service, and the run's store marks the turns it trained."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from agents.config import EnvConfig
from agents.store import Store
from agents.trajectory import TurnStatus
from tests.trainers.test_run import TEST_DEFAULTS, TINY, TINY_CHAT
from trainers.compute_config import BackendConfig
from trainers.config import (
    MethodConfig,
    RunConfig,
    SFTConfig,
    TrainerConfig,
    validate,
)
from trainers.learning import TrainSample
from trainers.tinker_learner import datum, ppo_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = "tml-loopback"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def tinker_server(tmp_path):
    """clawgym's Tinker server on the tiny model, as `python -m trainers.tinker` starts it."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "trainers.tinker", f"tinker.port={port}", "model=tiny"]
        + [f"tinker.run_dir={tmp_path / 'tinker'}"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert server.poll() is None, server.stderr.read()[-3000:] if server.stderr else ""
        assert time.monotonic() < deadline, "the Tinker server did not answer in 2 minutes"
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    yield url, tmp_path / "tinker"
    server.terminate()
    server.wait(timeout=30)


def _train(url: str, run_dir, max_steps: int) -> dict:
    """`trainers.run backend=tinker` on chat with combine, TINKER_* pointing at `url`."""
    command = [sys.executable, "-m", "trainers.run", "backend=tinker", *TINY, *TEST_DEFAULTS]
    command += ["env=chat", TINY_CHAT, "method=combine", f"trainer.max_steps={max_steps}"]
    command += [f"run_dir={run_dir}"]
    environment = os.environ | {
        "TINKER_BASE_URL": url,
        "TINKER_API_KEY": KEY,
        "TINKER_TELEMETRY": "0",
    }
    result = subprocess.run(
        command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((run_dir / "summary.json").read_text())


def test_combine_trains_two_steps_through_the_tinker_server(tmp_path, tinker_server):
    url, server_dir = tinker_server
    run_dir = tmp_path / "run"
    summary = _train(url, run_dir, max_steps=2)
    assert (summary["engine"], summary["method"], summary["steps"]) == ("tinker", "combine", 2)
    assert summary["adapter_version"] == 2
    # each version is a pointer to a checkpoint the server saved for sampling
    for version in (1, 2):
        pointer = json.loads((run_dir / "adapters" / f"v{version}" / "tinker.json").read_text())
        assert pointer["model_path"].startswith("tinker://")
        assert pointer["model_path"].endswith(f"/v{version}")
    assert any(server_dir.rglob("*.safetensors")), "the server saved no weights"
    state = json.loads((run_dir / "checkpoints" / "latest" / "state.json").read_text())
    assert state["step"] == 2 and state["tinker_state"].startswith("tinker://")
    with Store(run_dir / "store.sqlite") as store:
        trained = store.turns(status=TurnStatus.TRAINED)
        assert len(trained) == summary["turns_trained"] >= 4  # two steps of batch_turns=2
        assert sorted(seq for seq, _ in trained) == sorted(sum(state["ledger"], []))
        for _, turn in trained:  # sampled by the service, with a log-prob per token
            assert turn.completion_token_ids and turn.completion_logprobs
            assert all(lp <= 0 for lp in turn.completion_logprobs)
        # combine's hints: the teacher's log-probs came from the service's base model
        assert any(t.judgement and t.judgement.teacher_logprobs for _, t in trained)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "env" not in r]
    assert [r["step"] for r in steps] == [1, 2]
    # step 1 trains the adapter that sampled its turns (version 0): the service's forward
    # pass recomputes their stored log-probs, so the ratio is 1 (inside PPO's clip range)
    # and Tinker's summed loss, divided out by the step's tokens, is minus the mean advantage
    assert steps[0]["logprob_gap"] < 1e-3 and steps[0]["clip_fraction"] == 0.0
    assert steps[0]["loss"] == pytest.approx(-steps[0]["mean_advantage"], abs=1e-3)


@pytest.mark.slow
def test_the_same_command_resumes_from_the_services_saved_state(tmp_path, tinker_server):
    url, _ = tinker_server
    run_dir = tmp_path / "run"
    first = _train(url, run_dir, max_steps=1)
    summary = _train(url, run_dir, max_steps=2)
    assert (first["steps"], summary["steps"], summary["adapter_version"]) == (1, 2, 2)
    state = json.loads((run_dir / "checkpoints" / "latest" / "state.json").read_text())
    ledger = sum(state["ledger"], [])
    assert len(state["ledger"]) == 2 and len(ledger) == len(set(ledger)), "a turn trained twice"
    with Store(run_dir / "store.sqlite") as store:
        assert sorted(seq for seq, _ in store.turns(status=TurnStatus.TRAINED)) == sorted(ledger)


def test_datum_shifts_tokens_and_scales_advantages_by_the_steps_tokens():
    sample = TrainSample(7, (1, 2, 3), (4, 5), (-0.5, -1.5), (1.0, -2.0), 0)
    d = datum(sample, tokens_in_step=4)
    assert d.model_input.to_ints() == [1, 2, 3, 4]
    inputs = {k: v.tolist() for k, v in d.loss_fn_inputs.items()}
    assert inputs["target_tokens"] == [2, 3, 4, 5]
    assert inputs["logprobs"] == [0.0, 0.0, -0.5, -1.5]
    assert inputs["advantages"] == [0.0, 0.0, 0.25, -0.5]


def test_ppo_config_is_the_trainers_clip_range():
    config = TrainerConfig(clip_low=0.2, clip_high=0.28)
    assert ppo_config(config) == pytest.approx(
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}
    )


def test_tinker_backend_without_a_key_says_how_to_set_it(monkeypatch):
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    config = RunConfig(
        env={"chat": EnvConfig(id="clawgym/Chat-v0")},
        backend=BackendConfig(kind="tinker"),
        method=MethodConfig(name="binary"),
        sft=SFTConfig(warm_start_steps=0),
    )
    with pytest.raises(ValueError, match="TINKER_API_KEY"):
        validate(config)
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    validate(config)
    with pytest.raises(ValueError, match="sft.warm_start_steps=0"):
        validate(
            dataclasses.replace(config, sft=dataclasses.replace(config.sft, warm_start_steps=2))
        )
    with pytest.raises(ValueError, match="trainer.kl_weight=0"):
        validate(dataclasses.replace(config, trainer=TrainerConfig(kl_weight=0.1)))
