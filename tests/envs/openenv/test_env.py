"""`clawgym/OpenEnv-v0` pointed at a clawgym env served over OpenEnv: Gymnasium's checker,
the gold test (the served env's reference solution, driven by an in-process twin of the
same seed, earns full reward; a do-nothing agent none), and a server that goes away."""

from __future__ import annotations

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

from envs.core import ERROR_PREFIX, IdleAgent, run_episode
from envs.openenv.env import OpenEnvEnv


def test_it_passes_gymnasiums_checker(serve):
    served = serve("clawgym/Arith-v0")
    env = gym.make("clawgym/OpenEnv-v0", base_url=served.base_url)
    try:
        check_env(env.unwrapped)
    finally:
        env.close()
    assert served.sessions.active_sessions == 0


class TwinReference:
    """The served env's reference agent, read off an in-process env reset with the same
    seed (the answer key stays on the server, so OpenEnv-v0 has no reference of its own)."""

    def __init__(self, env_id: str, seed: int):
        self.twin = gym.make(env_id).unwrapped
        self.twin.reset(seed=seed)
        self.agent = self.twin.reference_agent()

    def act(self, observation, info):
        return self.agent.act(observation, info)


@pytest.mark.parametrize("seed", [0, 11])
def test_gold(serve, seed):
    served = serve("clawgym/Arith-v0")
    env = OpenEnvEnv(served.base_url)
    try:
        assert not hasattr(env, "reference_agent")  # the answer key stays on the server
        gold = run_episode(env, TwinReference("clawgym/Arith-v0", seed), seed=seed)
        assert (gold.total_reward, gold.terminated, gold.truncated) == (1.0, True, False)
        idle = run_episode(env, IdleAgent(), seed=seed)
        assert (idle.total_reward, idle.terminated, idle.truncated) == (0.0, False, True)
        assert idle.task_id == gold.task_id
        assert served.sessions.active_sessions == 1  # one session for the env's whole life
    finally:
        env.close()
        env.close()
    assert served.sessions.active_sessions == 0


def test_a_server_that_goes_away_ends_the_episode_truncated(serve):
    served = serve("clawgym/Arith-v0", api_key="k")
    env = OpenEnvEnv(served.base_url, api_key="k", timeout=10)
    try:
        observation, info = env.reset(seed=0)
        assert {t["function"]["name"] for t in info["tools"]} == {"calculator", "submit"}
        assert set(env.action_space.tool_names) == {"calculator", "submit"}
        served.stop()
        observation, reward, terminated, truncated, info = env.step("Answer: 1")
        assert (reward, terminated, truncated) == (0.0, False, True) and "aborted" in info
        assert observation[0]["content"].startswith(ERROR_PREFIX)
        with pytest.raises(RuntimeError, match="finished episode"):
            env.step("again")
    finally:
        env.close()
