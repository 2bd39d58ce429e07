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
from trainers.config import RunConfig, register_configs

GROUPS = sorted(p.stem for p in (Path(agents.conf.__file__).parent / "env").glob("*.yaml"))


def run_config(*overrides: str) -> RunConfig:
    register_configs()
    with initialize(config_path="../../trainers/conf", version_base=None):
        cfg = compose("config", overrides=list(overrides))
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def test_every_registered_family_has_a_group():
    families = {env_id.split("/")[1].removesuffix("-v0").lower() for env_id in ENVIRONMENTS}
    assert families <= set(GROUPS)


@pytest.mark.parametrize("group", [g for g in GROUPS if g not in ("gui", "swe", "terminal")])
def test_each_group_composes_and_its_env_is_made(group):
    config = run_config(f"env={group}")
    validate_env(config.env)
    assert config.env.id in ENVIRONMENTS and config.env.group_size >= 1
    env = env_factory(config.env)()
    try:
        _, info = env.reset(seed=0)
        assert info["task_id"] in env.unwrapped.task_ids()
    finally:
        env.close()


@pytest.mark.parametrize("group", ["gui", "swe", "terminal"])
def test_sandboxed_and_browser_groups_compose(group):
    config = run_config(f"env={group}")
    validate_env(config.env)
    assert config.env.id in ENVIRONMENTS and config.env.kwargs["split"] == "train"
    assert config.env.kwargs["max_turns"] >= 10
