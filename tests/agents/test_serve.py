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
from hydra import compose as compose_config
from hydra import initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from agents.api_keys import user_of_key
from agents.compose import proxy_config
from agents.config import ModelConfig, validate_serve
from agents.engines.vllm_server import free_port
from agents.serve import ServeRunConfig, serve
from agents.store import Store


def compose(*overrides: str) -> ServeRunConfig:
    """The config `python -m agents.serve OVERRIDES` runs with."""
    with initialize_config_module("agents.conf", version_base=None):
        cfg = compose_config("serve", overrides=list(overrides))
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def test_overrides_compose_the_shared_groups_into_a_typed_config():
    config = compose("engine=vllm", "model=smollm2-135m", "serve.port=31000", "store=x.sqlite")
    assert isinstance(config, ServeRunConfig)
    assert (config.engine.backend, config.engine.max_loras, config.model.name) == (
        "vllm",
        2,
        "smollm2-135m",
    )
    assert (config.serve.port, config.serve.host, config.store) == (31000, "127.0.0.1", "x.sqlite")
    assert compose().engine.backend == "embedded" and compose().model.name == "tiny"
    remote = compose("engine=remote", "engine.base_url=http://127.0.0.1:1/v1")
    assert remote.engine.token_ids is False and remote.engine.base_url.endswith("/v1")


@pytest.mark.parametrize(
    "overrides, error",
    [
        (["serve.host=0.0.0.0"], "api_key"),
        (["serve.api_keys=[k1,k2,k3]", "serve.api_keys_file=/no/such"], "cannot read"),
        (["serve.turn_type=both"], "turn_type"),
        (["serve.session_idle_s=0"], "session_idle_s"),
        (["serve.port=0"], "name a port"),
        (["engine=remote"], "base_url"),
        (["engine=vllm", "engine.max_loras=1"], "max_loras"),
        (["engine.backend=magic"], "engine=embedded"),
    ],
)
def test_bad_settings_say_what_to_fix(overrides, error, monkeypatch):
    monkeypatch.delenv("CLAWGYM_API_KEY", raising=False)
    with pytest.raises(ValueError, match=error):
        serve(compose(*overrides))


def test_a_key_from_the_environment_allows_binding_beyond_loopback(monkeypatch):
    monkeypatch.setenv("CLAWGYM_API_KEY", "k")
    section = compose("serve.host=0.0.0.0").serve
    assert proxy_config(section, ModelConfig("tiny")).api_key == "k"


def test_users_keys_allow_binding_beyond_loopback_and_reach_the_proxy(monkeypatch, tmp_path):
    monkeypatch.delenv("CLAWGYM_API_KEY", raising=False)
    keys_file = tmp_path / "keys"
    keys_file.write_text("# rotated\nalice tml-a2\n")
    overrides = [
        "serve.host=0.0.0.0",
        "serve.api_keys=[tml-solo]",
        f"serve.api_keys_file={keys_file}",
    ]
    section = compose(*overrides).serve
    validate_serve(section)
    config = proxy_config(section, ModelConfig("tiny"))
    assert config.api_key is None
    assert config.user_keys == {"tml-solo": user_of_key("tml-solo"), "tml-a2": "alice"}


def test_an_unknown_setting_is_refused_by_the_schema():
    with pytest.raises(ConfigCompositionException):
        compose("colour=blue")


def test_the_command_serves_records_and_stops_on_ctrl_c(tmp_path):
    port, store = free_port(), tmp_path / "store.sqlite"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agents.serve",
            "model=tiny",
            f"serve.port={port}",
            f"store={store}",
            "engine.threads=1",
            "serve.log_level=warning",
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
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
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
