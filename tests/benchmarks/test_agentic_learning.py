"""The agentic learning benchmark's plan: each env's SFT run, then each RL method from it."""

import argparse
from pathlib import Path

from benchmarks.agentic_learning import rl_eval_every, stages


def _args(**changes) -> argparse.Namespace:
    values = dict(
        envs=["terminal"],
        methods=["binary", "combine"],
        model="tiny",
        demonstrations=8,
        sft_steps=4,
        sft_lr=5e-4,
        rl_steps=4,
        rl_lr=1e-4,
        eval_episodes=6,
        rl_eval_every=None,
        seed=0,
        out=Path("out"),
    )
    return argparse.Namespace(**(values | changes))


def test_rl_runs_start_from_the_sft_run_and_evaluate_at_start_middle_and_end():
    planned = stages(_args())
    assert [(s.env, s.name) for s in planned] == [
        ("terminal", "sft"),
        ("terminal", "binary"),
        ("terminal", "combine"),
    ]
    binary = planned[1].overrides
    assert "trainer.init_adapter=out/terminal-sft" in binary and "judge=env" in binary
    assert "eval.every=2" in binary and "sft.warm_start_steps=0" in binary
    assert "judge=self" in planned[2].overrides


def test_rl_eval_every_zero_evaluates_at_start_and_end_only():
    assert rl_eval_every(_args(rl_eval_every=0)) == 0
    assert rl_eval_every(_args(rl_steps=1)) == 1
    assert "eval.every=0" in stages(_args(rl_eval_every=0))[1].overrides
