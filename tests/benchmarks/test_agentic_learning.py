"""The agentic learning benchmark's plan: each env's SFT run, then each RL method from it."""

import argparse
from pathlib import Path

from agents.store import Store
from agents.trajectory import Session, SessionStatus, TurnType
from benchmarks.agentic_learning import (
    pass_at_k,
    rl_eval_every,
    solved_by_family,
    stages,
    task_family,
    wall_to_last_step,
)
from tests.agents.test_trajectory import make_turn


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
        check_start=False,
        pass_k_at=["before", "after"],
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


def test_binary_is_run_with_and_without_dynamic_sampling_by_name():
    # filter_groups defaults to true (trainers/config.py), so the plain line turns it off
    planned = stages(_args(envs=["shop"], methods=["binary", "binary-dynamic"]))
    assert [(s.env, s.name) for s in planned] == [
        ("shop", "sft"),
        ("shop", "binary"),
        ("shop", "binary-dynamic"),
    ]
    sft, plain, dynamic = (s.overrides for s in planned)
    assert "env=shop" in sft and "method=sft" in sft
    assert "method.filter_groups=false" in plain and "method.filter_groups=true" in dynamic
    assert "trainer.init_adapter=out/shop-sft" in dynamic and "method=binary" in dynamic
    # pass@k at each run's start (the base model) and end, not between
    assert all("eval.pass_k_at=[before,after]" in s for s in (sft, plain, dynamic))
    assert "eval.pass_k_at=[after]" in stages(_args(pass_k_at=["after"]))[0].overrides


def test_pass_at_k_cell_names_k_and_interval_or_says_it_was_not_drawn():
    score = {"pass_at_k": 0.42, "k": 4, "pass_at_k_low": 0.33, "pass_at_k_high": 0.521234}
    assert pass_at_k(score) == "0.420 (k=4) [0.330, 0.521]"
    assert pass_at_k({"pass_at_k": None, "k": 0}) == "-"
    assert pass_at_k({"pass_at_1": 0.5}) == "-"  # a summary from before pass@k


def test_rl_eval_every_zero_evaluates_at_start_and_end_only():
    assert rl_eval_every(_args(rl_eval_every=0)) == 0
    assert rl_eval_every(_args(rl_steps=1)) == 1
    assert "eval.every=0" in stages(_args(rl_eval_every=0))[1].overrides


def test_rl_runs_leave_their_start_to_the_sft_runs_evaluation_unless_asked_to_check_it():
    sft, binary, _ = stages(_args())
    assert "eval.before=false" in binary.overrides
    assert not any(o.startswith("eval.before") for o in sft.overrides)  # the base model's score
    assert "eval.before=true" in stages(_args(check_start=True))[1].overrides


def test_wall_to_last_step_adds_each_process_up_to_its_last_step():
    # a first process stopped after step 2 (at 300 s), a resumed one ran steps 3 and 4
    # (elapsed from its own start); env and evaluation rows carry no elapsed time
    records = [
        {"step": 1, "elapsed_s": 120.0, "seconds": 30.0},
        {"step": 1, "env": "toolcall", "episodes": 8},
        {"step": 2, "elapsed_s": 300.0, "seconds": 40.0},
        {"step": 3, "elapsed_s": 50.0, "seconds": 20.0},
        {"step": 4, "elapsed_s": 95.5, "seconds": 20.0},
        {"step": 4, "env": "toolcall", "eval_pass_at_1": 0.5},
    ]
    assert wall_to_last_step(records) == 300.0 + 95.5
    assert wall_to_last_step(records[:3]) == 300.0
    assert wall_to_last_step([]) == 0.0


def test_task_families_are_ids_less_source_and_number():
    assert task_family("bfcl/live_multiple_7-3-2") == "live_multiple"
    assert task_family("bfcl/irrelevance_104") == "irrelevance"
    assert task_family("bfcl/simple_python_5") == "simple_python"


def test_each_evaluation_is_counted_per_family_apart_by_the_version_that_played_it_once(tmp_path):
    played = [  # (policy version, task, outcome); version 0 played first, then version 4
        (0, "bfcl/irrelevance_1", 1.0),
        (0, "bfcl/irrelevance_2", 1.0),
        (0, "bfcl/simple_python_3", 0.0),
        (4, "bfcl/irrelevance_1", 0.0),
        (4, "bfcl/irrelevance_2", 1.0),
        (4, "bfcl/simple_python_3", 1.0),
        # the run stopped during version 4's evaluation and, resumed, played it again:
        # each task counts its last play once
        (4, "bfcl/irrelevance_1", 1.0),
        (4, "bfcl/simple_python_3", 0.0),
    ]
    with Store(tmp_path / "store.sqlite") as store:
        for n, (version, task, outcome) in enumerate(played):
            session = f"s{n}"
            store.add_session(Session(session, "eval/toolcall", task_id=task))
            store.add_turn(
                make_turn(session_id=session, turn_type=TurnType.SIDE, policy_version=version)
            )
            store.finish_session(session, outcome, SessionStatus.DONE)
        # a training episode of the same task is not an evaluation
        store.add_session(Session("train", "toolcall", task_id="bfcl/irrelevance_1"))
        store.add_turn(make_turn(session_id="train", policy_version=4))
        store.finish_session("train", 1.0, SessionStatus.DONE)
    assert solved_by_family(tmp_path, "toolcall") == [
        {"irrelevance": (2, 2), "simple_python": (0, 1)},
        {"irrelevance": (2, 2), "simple_python": (0, 1)},
    ]
