"""The example env of docs/environments.md: its gold test, Gymnasium's checker, and a training
run that names it from the command line, as a user's own env is trained."""

import json
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

from envs.core import IdleAgent, run_episode
from examples.guess_number import ENV_ID
from examples.guess_number.env import SPLIT_SIZES, GuessNumberEnv

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("split", sorted(SPLIT_SIZES))
def test_bisection_finds_every_secret_within_seven_guesses_and_idle_finds_none(split):
    env = GuessNumberEnv(split=split)
    for task_id in env.task_ids():
        result = run_episode(env, env.reference_agent(), task_id=task_id)
        assert (result.total_reward, result.terminated) == (1.0, True), task_id
        assert result.turns <= 7
    idle = run_episode(env, IdleAgent(), task_id=env.task_ids()[0])
    assert (idle.total_reward, idle.truncated) == (0.0, True)


def test_the_env_answers_higher_lower_and_refuses_a_guess_out_of_range():
    env = GuessNumberEnv(max_turns=5)
    env.reset(options={"task_id": "train-0"})
    assert env.secret == 51  # the same on every machine
    for number, answer in ((0, "[error] 0 is outside 1..100"), (50, "higher"), (52, "lower")):
        observation, reward, terminated, _, _ = env.step(
            {"role": "assistant", "content": "", "tool_calls": [_call(number)]}
        )
        assert (observation[-1]["content"], reward, terminated) == (answer, 0.0, False)
    _, reward, terminated, _, _ = env.step(
        {"role": "assistant", "content": "", "tool_calls": [_call(51)]}
    )
    assert (reward, terminated) == (1.0, True)


def test_the_id_registers_on_import_and_passes_gymnasiums_checker():
    env = gym.make(ENV_ID).unwrapped
    check_env(env, skip_render_check=True)
    env.close()


def test_a_run_names_the_example_env_from_the_command_line_and_trains_on_it(tmp_path):
    """`python -m trainers.run` with the example's config on Hydra's search path: the
    reference agent's demonstrations warm-start the tiny policy (one supervised step), two RL
    steps train on the env's episodes, and the held-out split is evaluated before, at the
    switch and after."""
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "trainers.run",
        "hydra.searchpath=[pkg://agents.conf,pkg://examples.conf]",
        "env=guess_number",
        "env.guess_number.group_size=2",
        "env.guess_number.max_tokens=16",
        # 1..7 is bisected in 3 guesses: the reference agent's demonstrations all succeed
        "env.guess_number.kwargs.high=7",
        "env.guess_number.kwargs.max_turns=3",
        "model=tiny",
        "trainer.lora_rank=4",
        "trainer.batch_turns=4",
        "trainer.max_steps=2",
        "sft.episodes=4",
        "sft.warm_start_steps=1",
        "eval.episodes=2",
        "eval.pass_k_at=[]",
        # the random tiny model finds no secret: every group scores 0
        "method.filter_groups=false",
        "rollout.max_signalless_groups=0",
        f"run_dir={run_dir}",
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3  # one supervised step, then two RL steps
    assert summary["envs"]["guess_number"]["episodes"] > 0
    held_out = summary["held_out"]["guess_number"]
    assert {"before", "switch", "after"} <= set(held_out)
    assert held_out["after"]["episodes"] == 2
    assert "examples.guess_number:example/GuessNumber-v0" in (run_dir / "config.yaml").read_text()
    assert (run_dir / "adapters" / "v3" / "adapter_model.safetensors").exists()


def _call(number: int) -> dict:
    arguments = json.dumps({"number": number})
    return {"id": "c0", "type": "function", "function": {"name": "guess", "arguments": arguments}}
