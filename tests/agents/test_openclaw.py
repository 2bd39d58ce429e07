"""OpenClaw itself as the client: two turns of one OpenClaw session (`openclaw agent --local`)
against a real `python -m agents.serve` process on loopback, then the store is checked.

OpenClaw is installed by scripts/setup_openclaw.sh (part of scripts/setup.sh) under
.openclaw-node/; without it the test is skipped. Its prompt is over 14k tokens of the `tiny`
tokenizer even with workspace files and skills left out, so the proxy serves `tiny` with
`context_length=32768` (a shorter context gets OpenClaw a clean 400, which it reports as
a context overflow). 70 s to over 2 minutes on 2 shared cores (OpenClaw's start-up, the
long prefill), so it is also marked `slow`: run it with `pytest -m openclaw`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agents.engines.vllm_server import free_port
from agents.serving.histories import INTERNAL_CONTEXT
from agents.serving.identity import bearer, home_credentials, scope_of, stored_id
from agents.store import Store
from agents.trajectory import TurnType

ROOT = Path(__file__).resolve().parents[2]
OPENCLAW = Path(os.environ.get("CLAWGYM_OPENCLAW_DIR") or ROOT / ".openclaw-node") / "bin/openclaw"
SESSION = "claw-session-1"
# What OpenClaw sends as its bearer token; on a proxy without a key any credential is let in
# and its sessions are its own: the store keeps them under the credential's scope.
KEY = "unused-on-loopback"
STORED = stored_id(scope_of(bearer(KEY), home_credentials(None)), SESSION)

# Slow as well: over a minute, so out of the default run; `pytest -m openclaw` runs it.
pytestmark = [
    pytest.mark.openclaw,
    pytest.mark.slow,
    pytest.mark.skipif(
        not OPENCLAW.exists(),
        reason=f"OpenClaw is not installed ({OPENCLAW}): run scripts/setup_openclaw.sh",
    ),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """`python -m agents.serve` on `tiny` with a context that fits OpenClaw's prompt."""
    store = tmp_path_factory.mktemp("openclaw-proxy") / "store.sqlite"
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "agents.serve",
        f"serve.port={port}",
        f"store={store}",
        "model=tiny",
        "engine.threads=2",
        "engine.context_length=32768",
        "serve.log_level=warning",
    ]
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "CLAWGYM_API_KEY": ""})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while process.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(base + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail("python -m agents.serve did not come up")
        yield base + "/v1", store
    finally:
        process.terminate()
        process.wait(timeout=60)


def openclaw_home(root: Path, base_url: str) -> Path:
    """OpenClaw's state directory with the proxy as its only provider.

    Workspace bootstrap files and skills are left out of its prompt (about 20k fewer
    tokens); its tools and its per-request internal-context message stay.
    """
    config = {
        "models": {
            "providers": {
                "clawgym": {
                    "baseUrl": base_url,
                    "apiKey": KEY,
                    "api": "openai-completions",
                    "models": [
                        {
                            "id": "policy",
                            "name": "policy",
                            "contextWindow": 32768,
                            "maxTokens": 8,
                            "compat": {"sendSessionAffinityHeaders": True},
                        }
                    ],
                }
            }
        },
        "agents": {
            "defaults": {
                "model": {"primary": "clawgym/policy"},
                "skipBootstrap": True,
                "contextInjection": "never",
                "skills": [],
            }
        },
    }
    (root / ".openclaw").mkdir(parents=True)
    (root / ".openclaw" / "openclaw.json").write_text(json.dumps(config, indent=1))
    return root


def say(home: Path, message: str) -> dict:
    """One turn of the OpenClaw session; its `--json` result."""
    done = subprocess.run(
        [
            str(OPENCLAW),
            "agent",
            "--local",
            "--session-id",
            SESSION,
            "--message",
            message,
            "--json",
        ],
        env={**os.environ, "OPENCLAW_HOME": str(home)},
        cwd=home,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert "error" not in result["meta"], result["meta"]["error"]
    return result


def test_two_openclaw_turns_are_recorded_and_linked(server, tmp_path):
    base_url, store_path = server
    home = openclaw_home(tmp_path / "home", base_url)
    first = say(home, "hello there")
    say(home, "second message")
    with Store(store_path) as store:
        (session,) = store.sessions()
        turns = store.session(session.session_id).turns
    # The session id comes from OpenClaw's affinity headers (`<id>:0`), not a fresh one.
    assert session.session_id == STORED
    assert [(t.index, t.turn_type) for t in turns] == [(0, TurnType.MAIN), (1, TurnType.MAIN)]
    for turn in turns:
        assert len(turn.prompt_token_ids) > 10_000 and turn.tools
        assert len(turn.completion_token_ids) == len(turn.completion_logprobs) > 0
    assert first["meta"]["finalAssistantRawText"] == turns[0].completion["content"]
    # The first turn's next state is the user's second message as OpenClaw sent it, not
    # the internal-context message that trails every request.
    (next_message,) = turns[0].next_state or ()
    assert next_message["role"] == "user"
    assert "second message" in json.dumps(next_message)
    assert INTERNAL_CONTEXT not in json.dumps(turns[0].next_state)
    assert turns[1].next_state is None
    # The second request's history carries the first reply as OpenClaw kept it.
    assert turns[0].completion["content"] in json.dumps(
        turns[1].prompt_messages, ensure_ascii=False
    )


def test_openclaw_drives_a_training_run_that_trains_on_its_turns(tmp_path):
    """OpenClaw-RL's own scenario end to end: `trainers.run env=chat env.chat.users=live`
    serves the policy, the real OpenClaw agent talks to it, the user's complaint is judged
    and the step trains on OpenClaw's turn."""
    run_dir, port = tmp_path / "run", free_port()
    command = [
        sys.executable,
        "-m",
        "trainers.run",
        "model=tiny",
        "env=chat",
        "env.chat.users=live",
        "judge=feedback",
        "method=binary",
        "eval.episodes=0",
        "trainer.batch_turns=1",
        "trainer.max_steps=1",
        "trainer.lora_rank=4",
        "engine.threads=2",
        "engine.context_length=32768",
        f"serve.port={port}",
        f"run_dir={run_dir}",
    ]
    trainer = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "CLAWGYM_API_KEY": ""},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert trainer.poll() is None, trainer.stderr.read()[-3000:]  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the trainer's proxy never answered"
            try:
                if httpx.get(base + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        home = openclaw_home(tmp_path / "home", base + "/v1")
        say(home, "What is the capital of France?")
        say(home, "That is wrong. Answer in one word.")
        assert trainer.wait(timeout=900) == 0, trainer.stderr.read()[-3000:]  # type: ignore[union-attr]
    finally:
        if trainer.poll() is None:
            trainer.kill()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["adapter_version"]) == (1, 1)
    with Store(run_dir / "store.sqlite") as store:
        turns = store.session(STORED).turns
    first = turns[0]
    assert first.judgement is not None and first.judgement.score == -1.0
    assert first.status == "trained" and len(first.prompt_token_ids) > 10_000
