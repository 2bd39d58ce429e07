"""`python -m agents.serve`: its config, and the real command serving and stopping."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from agents.engines.vllm_server import free_port
from agents.serve import ServeConfig, parse_args
from agents.store import Store


def test_arguments_become_a_typed_config():
    config = parse_args(["model=smollm2-135m", "port=31000", "threads=none", "remote_token_ids=1"])
    assert (config.model, config.port, config.threads, config.host) == (
        "smollm2-135m",
        31000,
        None,
        "127.0.0.1",
    )
    assert config.remote_token_ids is True
    assert parse_args(["session_idle_s=90.5"]).session_idle_s == 90.5


@pytest.mark.parametrize(
    "args, error",
    [
        (["colour=blue"], "key=value"),
        (["port=http"], "invalid literal"),
        (["engine=magic"], "engine"),
        (["host=0.0.0.0"], "api_key"),
        (["turn_type=both"], "turn_type"),
        (["engine=remote"], "base_url"),
        (["session_idle_s=0"], "session_idle_s"),
        (["session_idle_s=soon"], "could not convert"),
    ],
)
def test_bad_arguments_say_what_to_fix(args, error, monkeypatch):
    monkeypatch.delenv("CLAWGYM_API_KEY", raising=False)
    with pytest.raises(ValueError, match=error):
        parse_args(args)


def test_beyond_loopback_is_allowed_with_a_key():
    assert ServeConfig(host="0.0.0.0", api_key="k").host == "0.0.0.0"


def test_the_command_serves_records_and_stops_on_ctrl_c(tmp_path):
    port, store = free_port(), tmp_path / "store.sqlite"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agents.serve",
            "model=tiny",
            f"port={port}",
            f"store={store}",
            "threads=1",
            "log_level=warning",
        ],
        env={**os.environ, "CLAWGYM_API_KEY": ""},
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.with_raw_response.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        session_id = reply.headers["x-session-id"]
    finally:
        server.send_signal(signal.SIGINT)
        code = server.wait(timeout=60)
    assert code == 0
    with Store(store) as saved:
        assert len(saved.session(session_id).turns) == 1
