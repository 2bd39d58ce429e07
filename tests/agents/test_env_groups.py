"""Every environment family has a config group (agents/conf/env/) that composes into a
typed `EnvConfig` whose env the composition root can make."""

from pathlib import Path

import pytest
from hydra import compose, initialize
from omegaconf import OmegaConf

import agents.conf
from agents.compose import env_factory
from agents.config import validate_env
from envs.registry import ENVIRONMENTS
from trainers.config import RunConfig, register_configs, validate

GROUPS = sorted(p.stem for p in (Path(agents.conf.__file__).parent / "env").glob("*.yaml"))


def run_config(*overrides: str) -> RunConfig:
    register_configs()
    with initialize(config_path="../../trainers/conf", version_base=None):
        cfg = compose("config", overrides=list(overrides))
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def test_every_registered_family_has_a_group():
    families = {env_id.split("/")[1].removesuffix("-v0").lower() for env_id in ENVIRONMENTS}
    assert families <= set(GROUPS)


# gui, swe and terminal need a browser or sandboxes; tau2's user is the run's own server;
# openenv needs a server to play (tests/envs/openenv/)
@pytest.mark.parametrize(
    "group", [g for g in GROUPS if g not in ("gui", "swe", "terminal", "tau2", "openenv")]
)
def test_each_group_composes_and_its_env_is_made(group):
    config = run_config(f"env={group}")
    assert list(config.env) == [group]
    env_config = config.env[group]
    validate_env(env_config)
    assert env_config.id in ENVIRONMENTS and env_config.group_size >= 1
    env = env_factory(env_config)()
    try:
        _, info = env.reset(seed=0)
        assert info["task_id"] in env.unwrapped.task_ids()
    finally:
        env.close()


@pytest.mark.parametrize("group", ["gui", "swe", "terminal", "tau2"])
def test_sandboxed_browser_and_user_model_groups_compose(group):
    env_config = run_config(f"env={group}").env[group]
    validate_env(env_config)
    assert env_config.id in ENVIRONMENTS and env_config.kwargs["split"] == "train"
    assert env_config.kwargs["max_turns"] >= 10
    # an agentic turn (a command, a patch, a function call) needs more than a chat reply
    assert env_config.max_tokens is not None and env_config.max_tokens >= 96


def test_several_groups_compose_into_a_mixture_each_under_its_name():
    config = run_config(
        "env=[chat,arith,terminal,toolcall]", "judge=self", "env.terminal.group_size=2"
    )
    validate(config)
    assert list(config.env) == ["chat", "arith", "terminal", "toolcall"]
    assert config.env["terminal"].group_size == 2 and config.env["arith"].group_size == 4
    assert config.env["chat"].outcome_weight == 0.0 and config.env["arith"].outcome_weight == 1.0
    assert {config.env[n].id for n in config.env} == {
        "clawgym/Chat-v0",
        "clawgym/Arith-v0",
        "clawgym/Terminal-v0",
        "clawgym/ToolCall-v0",
    }


def test_tau2s_user_is_the_runs_own_server_with_the_adapter_off():
    from trainers.compose import with_run_endpoint

    tau2 = run_config("env=tau2").env["tau2"]
    assert (tau2.kwargs["user"], tau2.kwargs["user_base_url"]) == ("model", "run")
    pointed = with_run_endpoint(tau2, "http://127.0.0.1:4321/v1", None)
    assert pointed.kwargs["user_base_url"] == "http://127.0.0.1:4321/v1"
    assert pointed.kwargs["user_model"] == "base"
    terminal = run_config("env=terminal").env["terminal"]
    assert with_run_endpoint(terminal, "http://x/v1", None) is terminal
