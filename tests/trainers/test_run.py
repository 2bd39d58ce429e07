import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agents.store import Store
from agents.trajectory import TurnStatus
from trainers.config import RunConfig, validate

ROOT = Path(__file__).resolve().parents[2]
# Small enough for a 2-core CPU: one question per conversation, short replies, two turns a step.
TINY = [
    "model=tiny",
    "env.kwargs.questions_per_episode=1",
    "sampling.max_tokens=8",
    "judge.max_tokens=16",
    "trainer.batch_turns=2",
    "trainer.lora_rank=4",
]


def train(run_dir, *overrides, wait=True):
    command = [sys.executable, "-m", "trainers.run", *TINY, f"run_dir={run_dir}", *overrides]
    if not wait:
        return subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("method", ["binary", "opd", "combine"])
def test_each_method_trains_two_steps_on_chat_and_leaves_two_adapters(tmp_path, method):
    run_dir = tmp_path / method
    summary = train(run_dir, f"method={method}", "trainer.max_steps=2")
    assert (summary["method"], summary["steps"], summary["adapter_version"]) == (method, 2, 2)
    assert (run_dir / "adapters" / "v1" / "adapter_model.safetensors").exists()
    assert (run_dir / "adapters" / "v2" / "adapter_model.safetensors").exists()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["turns"] >= 2 for r in rows)
    assert list((run_dir / "tensorboard").iterdir())
    assert "name: " + method in (run_dir / "config.yaml").read_text()
    with Store(run_dir / "store.sqlite") as store:
        assert (
            store.count_turns(TurnStatus.TRAINED)
            == summary["turns_trained"]
            == sum(r["turns"] for r in rows)
        )
        if method == "opd":  # OPD trains only turns the judge wrote a hint for
            assert all(
                t.judgement.teacher_logprobs for _, t in store.turns(status=TurnStatus.TRAINED)
            )


def test_sigkill_mid_run_resumes_without_training_a_turn_twice_or_losing_one(tmp_path):
    run_dir = tmp_path / "run"
    victim = train(run_dir, "method=binary", "trainer.max_steps=4", wait=False)
    deadline = time.monotonic() + 600
    while not (run_dir / "checkpoints" / "latest" / "state.json").exists():
        assert victim.poll() is None, victim.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=60)
    with Store(run_dir / "store.sqlite") as store:
        before = {seq for seq, _ in store.turns()}

    summary = train(run_dir, "method=binary", "trainer.max_steps=4")
    state = json.loads((run_dir / "checkpoints" / "latest" / "state.json").read_text())
    ledger = [seq for step in state["ledger"] for seq in step]
    assert state["step"] == summary["adapter_version"] == 4 and len(state["ledger"]) == 4
    assert len(ledger) == len(set(ledger)), "a turn was trained twice"
    with Store(run_dir / "store.sqlite") as store:
        statuses = {seq: turn.status for seq, turn in store.turns()}
    assert before <= set(statuses), "a turn stored before the kill is gone"
    assert {s for s, status in statuses.items() if status == TurnStatus.TRAINED} == set(ledger)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda c: setattr(c.env, "group_size", 0), "env.group_size"),
        (lambda c: setattr(c.engine, "backend", "tgi"), "engine=embedded"),
        (lambda c: setattr(c.env, "id", "CartPole-v1"), "clawgym/"),
        (lambda c: setattr(c.method, "name", "ppo"), "method=binary"),
        (lambda c: setattr(c.judge, "kind", "remote"), "judge.base_url"),
        (
            lambda c: (setattr(c.method, "name", "opd"), setattr(c.judge, "kind", "env")),
            "LLM judge",
        ),
        (lambda c: setattr(c.trainer, "clip_low", 1.5), "clip_low"),
        (lambda c: setattr(c.trainer, "max_backlog", 4), "max_backlog"),
        (lambda c: setattr(c.env, "users", "robots"), "env.users"),
        (lambda c: setattr(c.serve, "host", "0.0.0.0"), "serve.api_key"),
        (lambda c: setattr(c.engine, "backend", "remote"), "engine.base_url"),
        (
            lambda c: (
                setattr(c.engine, "backend", "remote"),
                setattr(c.engine, "base_url", "http://127.0.0.1:1/v1"),
            ),
            "cannot train",
        ),
        (
            lambda c: (setattr(c.engine, "backend", "vllm"), setattr(c.trainer, "lora_rank", 32)),
            "engine.max_lora_rank",
        ),
        (lambda c: setattr(c.trainer, "device", "tpu"), "trainer.device"),
        (lambda c: setattr(c.trainer, "dtype", "fp8"), "trainer.dtype"),
    ],
)
def test_bad_config_values_say_the_fix(change, fragment):
    config = RunConfig()
    change(config)
    with pytest.raises(ValueError, match=fragment):
        validate(config)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_live_users_train_the_policy_they_talk_to(tmp_path):
    """`env.users=live`: the trainer serves the proxy; two people chat through the openai
    client; their feedback is judged and trained on, and the new adapter is what serves."""
    from openai import OpenAI

    run_dir, port = tmp_path / "live", _free_port()
    trainer = train(
        run_dir,
        "env.users=live",
        "judge=feedback",
        "method=binary",
        "trainer.max_steps=2",
        f"serve.port={port}",
        wait=False,
    )
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    deadline = time.monotonic() + 300
    while True:
        assert trainer.poll() is None, trainer.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "the trainer's proxy never answered"
        try:
            client.models.list()
            break
        except Exception:
            time.sleep(0.5)

    def say(session, history, text, done=False):
        history.append({"role": "user", "content": text})
        headers = {"X-Session-Id": session} | ({"X-Session-Done": "1"} if done else {})
        reply = client.chat.completions.create(
            model="policy", messages=history, max_tokens=8, extra_headers=headers
        )
        history.append({"role": "assistant", "content": reply.choices[0].message.content})
        return reply

    def chat(round_):
        for person, feedback in (("ana", "Too long. Keep it under five words."), ("bo", "Thanks!")):
            history: list[dict] = []
            say(f"{person}{round_}", history, "What is the capital of France?")
            say(f"{person}{round_}", history, feedback, done=True)

    def served_version():
        return httpx.get(f"http://127.0.0.1:{port}/healthz").json()["policy_version"]

    chat(1)
    while served_version() < 1:  # the first step trains on round 1 and publishes v1
        assert trainer.poll() is None, trainer.stderr.read()[-3000:]
        assert time.monotonic() < deadline + 300, "no adapter was published"
        time.sleep(0.2)
    chat(2)
    assert trainer.wait(timeout=600) == 0, trainer.stderr.read()[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["adapter_version"]) == (2, 2)
    with Store(run_dir / "store.sqlite") as store:
        turns = [t for _, t in store.turns()]
    scores = {t.session_id: t.judgement.score for t in turns if t.status == TurnStatus.TRAINED}
    assert scores == {"ana1": -1.0, "bo1": 1.0, "ana2": -1.0, "bo2": 1.0}
    assert {t.policy_version for t in turns if t.session_id.endswith("1")} == {0}
    assert {t.policy_version for t in turns if t.session_id.endswith("2")} == {1}
