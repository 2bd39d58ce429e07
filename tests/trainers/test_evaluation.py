"""Held-out evaluation across a resume: the evaluations recorded in metrics.jsonl come back,
and a step already evaluated is not played again."""

import dataclasses

import pytest

from agents.compose import env_factory
from agents.config import EnvConfig, SamplingConfig
from agents.rollout import TERMINATED, EpisodeSummary
from agents.store import Store
from agents.trajectory import Session, SessionStatus, TurnType
from tests.agents.test_trajectory import make_turn
from trainers import evaluation
from trainers.config import EvalConfig
from trainers.evaluation import EvalScore, Evaluator, eval_row, score_of
from trainers.metrics import MetricsWriter, read_metrics, record
from trainers.run import gain
from trainers.stats import wilson_interval


class Reached(Exception):
    pass


class Tripwire:
    """A seat that no episode may reach: any use of it raises `Reached` (no policy is
    served here; the tests only tell whether an evaluation plays)."""

    def __getattr__(self, name):
        raise Reached(name)


def test_a_score_survives_its_metrics_row():
    score = EvalScore(
        step=4, episodes=8, successes=3, pass_at_1=0.375, low=0.1, high=0.7, reward=0.4, failed=1
    )
    assert score_of(record(4, eval_row(score), env="arith")) == score


def episode(reward: float, status: SessionStatus = SessionStatus.DONE) -> EpisodeSummary:
    return EpisodeSummary("s", "t", reward, 2, 10, 5, True, status)


def test_partial_credit_is_reward_but_not_a_success():
    # InterCode-ALFA-like rewards: one solved, two near misses, one nothing, one broken off
    rewards = [1.0, 0.6, 0.3, 0.0, 0.0]
    statuses = [SessionStatus.DONE] * 4 + [SessionStatus.FAILED]
    held_out = evaluation.score(3, [episode(r, s) for r, s in zip(rewards, statuses, strict=True)])
    assert (held_out.successes, held_out.pass_at_1, held_out.failed) == (1, 0.2, 1)
    assert held_out.reward == pytest.approx(0.38)
    assert held_out.low == pytest.approx(0.036224, abs=1e-6)  # Wilson, 1 of 5, by hand
    assert held_out.high == pytest.approx(0.624465, abs=1e-6)


def test_a_resumed_evaluator_keeps_its_before_and_plays_only_steps_not_yet_evaluated(tmp_path):
    before = EvalScore(0, 2, 1, 0.5, 0.1, 0.9, 0.5, 0)
    at_two = EvalScore(2, 2, 2, 1.0, 0.3, 1.0, 1.0, 0)
    writer = MetricsWriter(tmp_path)
    for score in (before, at_two):
        writer.write(score.step, eval_row(score), env="arith")
    writer.write(2, {"loss": 0.5})  # a step's row, not an evaluation
    arith = EnvConfig(id="clawgym/Arith-v0", kwargs={"split": "train", "max_turns": 2})
    evaluator = Evaluator(
        EvalConfig(episodes=2),
        {"arith": arith},
        env_factory,
        Tripwire(),
        SamplingConfig(max_tokens=4),
        writer,
        tmp_path,
    )
    evaluator.restore(read_metrics(tmp_path))
    assert evaluator.started
    assert evaluator.evaluate(2) == {}  # evaluated before the kill: not played again
    with pytest.raises(Reached):  # a step not evaluated yet is played
        evaluator.evaluate(3)
    writer.close()
    held_out = evaluator.before_after()["arith"]
    assert held_out["before"] == dataclasses.asdict(before)
    assert held_out["after"] == dataclasses.asdict(at_two)
    assert [step for step, *_ in held_out["curve"]] == [0, 2]


def test_an_env_sets_its_own_number_of_held_out_episodes(tmp_path):
    arith = EnvConfig(id="clawgym/Arith-v0", kwargs={"split": "train", "max_turns": 2})
    envs = {
        "default": arith,
        "more": dataclasses.replace(arith, eval_episodes=5),
        "none": dataclasses.replace(arith, eval_episodes=0),
    }
    evaluator = Evaluator(
        EvalConfig(episodes=2), envs, env_factory, Tripwire(), SamplingConfig(), None, tmp_path
    )
    assert evaluator.episodes == {"default": 2, "more": 5, "none": 0}
    assert set(evaluator.makers) == {"default", "more"} and evaluator.enabled
    only_none = Evaluator(
        EvalConfig(episodes=2),
        {"none": envs["none"]},
        env_factory,
        Tripwire(),
        SamplingConfig(),
        None,
        tmp_path,
    )
    assert not only_none.enabled


def store_episode(store, n, env_id, task, version, reward, status=SessionStatus.DONE):
    """An ended two-turn episode of `task`, played by policy version `version`."""
    session = f"s{n}"
    store.add_session(Session(session, env_id, task_id=task))
    for index in (0, 1):
        store.add_turn(
            make_turn(
                session_id=session, index=index, turn_type=TurnType.SIDE, policy_version=version
            )
        )
    reason = TERMINATED if status == SessionStatus.DONE else "the environment failed: boom"
    store.finish_session(session, reward, status, reason)


def stored_evaluator(config: EvalConfig, run_dir, store) -> Evaluator:
    """An evaluator of two-turn arith episodes that finds earlier ones in `store` and
    reaches no policy (`Tripwire`)."""
    arith = EnvConfig(id="clawgym/Arith-v0", kwargs={"split": "train", "max_turns": 2})
    return Evaluator(
        config,
        {"arith": arith},
        env_factory,
        Tripwire(),
        SamplingConfig(max_tokens=4),
        None,
        run_dir,
        store,
    )


def test_an_evaluation_stopped_halfway_plays_only_the_episodes_its_version_did_not_finish(
    tmp_path,
):
    store = Store(tmp_path / "store.sqlite")

    def evaluator():
        return stored_evaluator(EvalConfig(episodes=3), tmp_path, store)

    tasks = evaluator().held_out_tasks("arith")
    assert len(tasks) == 3
    played = [  # (env id, task, policy version, reward, status), oldest first
        ("eval/arith", tasks[0], 4, 0.0, SessionStatus.DONE),  # the evaluation before
        ("eval/arith", tasks[0], 5, 1.0, SessionStatus.DONE),
        ("eval/arith", tasks[1], 5, 1.0, SessionStatus.FAILED),  # broken off: played again
        ("arith", tasks[2], 5, 1.0, SessionStatus.DONE),  # a training episode
    ]
    for n, episode_of in enumerate(played):
        store_episode(store, n, *episode_of)
    with pytest.raises(Reached):  # tasks 1 and 2 have no finished episode of version 5
        evaluator().evaluate(3, version=5)
    store_episode(store, 10, "eval/arith", tasks[1], 5, 0.0)
    store_episode(store, 11, "eval/arith", tasks[2], 5, 1.0, SessionStatus.TRUNCATED)
    with pytest.raises(Reached):  # a version not known takes nothing back
        evaluator().evaluate(3)
    # every task has an ended episode of version 5 now: nothing is played
    held_out = evaluator().evaluate(3, version=5)["arith"]
    assert (held_out.episodes, held_out.successes, held_out.failed) == (3, 2, 0)
    assert held_out.reward == pytest.approx(2 / 3)
    taken = evaluator().played("arith", 5, tasks)
    assert [taken[t].session_id for t in tasks] == ["s1", "s10", "s11"]
    assert (taken[tasks[0]].turns, taken[tasks[0]].completion_tokens) == (2, 4)
    assert taken[tasks[0]].terminated and taken[tasks[2]].status == SessionStatus.TRUNCATED
    assert evaluator().played("arith", 6, tasks) == {}
    store.close()


def test_pass_at_k_counts_tasks_any_of_whose_samples_solved_them():
    # three tasks, greedy: solved, failed, failed; their k = 2 samples: (1, 0), (0, 1), (0, 0)
    greedy = [episode(1.0), episode(0.0), episode(0.0)]
    samples = [[episode(1.0), episode(0.0)], [episode(0.0), episode(1.0)], [episode(0.0)] * 2]
    held_out = evaluation.score(5, greedy, samples)
    assert (held_out.k, held_out.pass_at_1) == (2, pytest.approx(1 / 3, abs=1e-6))
    assert held_out.pass_at_k == pytest.approx(2 / 3, abs=1e-6)  # tasks 1 and 2 of 3
    assert held_out.sampled_pass_at_1 == pytest.approx(1 / 3, abs=1e-6)  # first samples: 1, 0, 0
    low, high = wilson_interval(2, 3)
    assert (held_out.pass_at_k_low, held_out.pass_at_k_high) == (
        pytest.approx(low, abs=1e-6),
        pytest.approx(high, abs=1e-6),
    )
    # without samples there is no pass@k, and an old metrics row (no pass@k fields) reads back
    plain = evaluation.score(5, greedy)
    assert (plain.k, plain.pass_at_k, plain.sampled_pass_at_1) == (0, None, None)
    old_row = {k: v for k, v in eval_row(plain).items() if "pass_at_k" not in k}
    old_row.pop("eval_k")
    old_row.pop("eval_sampled_pass_at_1")
    assert score_of(record(5, old_row, env="arith")) == plain
    assert score_of(record(5, eval_row(held_out), env="arith")) == held_out


def test_a_tasks_samples_may_stop_at_its_first_success():
    # k = 3: task 0 solved by its first sample, task 1 by its second, task 2 by none
    samples = [[episode(1.0)], [episode(0.0), episode(1.0)], [episode(0.0)] * 3]
    held_out = evaluation.score(5, [episode(0.0)] * 3, samples, k=3)
    assert (held_out.k, held_out.pass_at_k) == (3, pytest.approx(2 / 3, abs=1e-6))
    assert held_out.sampled_pass_at_1 == pytest.approx(1 / 3, abs=1e-6)


def store_sample(store, name, task, version, reward, sample):
    """An ended one-turn pass@k sample of `task` (index `sample`) by policy `version`."""
    store.add_session(
        Session(name, "eval/arith", task_id=task, metadata={evaluation.SAMPLE_KEY: sample})
    )
    store.add_turn(
        make_turn(session_id=name, index=0, turn_type=TurnType.SIDE, policy_version=version)
    )
    store.finish_session(name, reward, SessionStatus.DONE, TERMINATED)


def test_a_sample_after_one_that_solved_its_task_is_not_played(tmp_path):
    store = Store(tmp_path / "store.sqlite")
    evaluator = stored_evaluator(EvalConfig(episodes=2, pass_k=2), tmp_path, store)
    solved_task, unsolved_task = evaluator.held_out_tasks("arith")
    for n, task in enumerate((solved_task, unsolved_task)):
        store_episode(store, n, "eval/arith", task, 5, 0.0)  # greedy: both failed
    store_sample(store, "a0", solved_task, 5, 1.0, sample=0)
    store_sample(store, "b0", unsolved_task, 5, 0.0, sample=0)
    with pytest.raises(Reached):  # the unsolved task's second sample must be played
        evaluator.evaluate(7, version=5)
    store_sample(store, "b1", unsolved_task, 5, 1.0, sample=1)
    # the solved task's second sample is never played (the seat would raise)
    held_out = evaluator.evaluate(7, version=5)["arith"]
    assert (held_out.pass_at_1, held_out.k, held_out.pass_at_k) == (0.0, 2, 1.0)
    assert held_out.sampled_pass_at_1 == pytest.approx(0.5)
    store.close()


def test_the_pass_at_k_samples_are_kept_apart_from_the_greedy_episodes_on_resume(tmp_path):
    store = Store(tmp_path / "store.sqlite")
    evaluator = stored_evaluator(EvalConfig(episodes=2, pass_k=2), tmp_path, store)
    tasks = evaluator.held_out_tasks("arith")
    store_episode(store, 0, "eval/arith", tasks[0], 5, 1.0)  # greedy
    session = "sampled"
    store.add_session(
        Session(session, "eval/arith", task_id=tasks[0], metadata={evaluation.SAMPLE_KEY: 1})
    )
    store.add_turn(
        make_turn(session_id=session, index=0, turn_type=TurnType.SIDE, policy_version=5)
    )
    store.finish_session(session, 0.0, SessionStatus.DONE, TERMINATED)
    assert [s.session_id for s in evaluator.played("arith", 5, tasks).values()] == ["s0"]
    assert [s.session_id for s in evaluator.played("arith", 5, tasks, 1).values()] == [session]
    assert evaluator.played("arith", 5, tasks, 0) == {}
    assert evaluator.pass_k == {"arith": 2}
    store.close()


@pytest.mark.parametrize("every", [True, False])
def test_pass_k_at_names_the_evaluations_that_draw_samples(tmp_path, every):
    """With the greedy episodes in the store, an evaluation plays (and reaches the
    `Tripwire`) only for pass@k samples: at the switch and after, and every few steps only
    where `eval.pass_k_at` names it."""
    store = Store(tmp_path / "store.sqlite")
    occasions = ["switch", "after", *(["every"] if every else [])]
    config = EvalConfig(episodes=2, pass_k=2, pass_k_at=occasions)
    evaluator = stored_evaluator(config, tmp_path, store)
    evaluator.switch_step = 3
    for n, task in enumerate(evaluator.held_out_tasks("arith")):
        store_episode(store, n, "eval/arith", task, 5, 1.0)
    with pytest.raises(Reached):
        evaluator.evaluate(3, version=5, between=True)  # the switch: samples all the same
    with pytest.raises(Reached):
        evaluator.evaluate(8, version=5)  # the after
    assert [
        evaluator.occasion(s, b) for s, b in ((0, False), (3, True), (6, True), (8, False))
    ] == [
        "before",
        "switch",
        "every",
        "after",
    ]
    if every:
        with pytest.raises(Reached):
            evaluator.evaluate(6, version=5, between=True)
    else:
        scores = evaluator.evaluate(6, version=5, between=True)
        assert (scores["arith"].pass_at_1, scores["arith"].k) == (1.0, 0)
    store.close()


def test_pass_k_defaults_to_each_envs_group_size(tmp_path):
    arith = EnvConfig(id="clawgym/Arith-v0", kwargs={"split": "train"}, group_size=4)
    evaluator = Evaluator(
        EvalConfig(episodes=2),
        {"arith": arith},
        env_factory,
        Tripwire(),
        SamplingConfig(),
        None,
        tmp_path,
    )
    assert evaluator.pass_k == {"arith": 4}


def test_a_phase_gain_says_whether_the_intervals_are_disjoint():
    switch = {"pass_at_1": 0.30, "low": 0.22, "high": 0.40}
    assert gain(switch, {"pass_at_1": 0.55, "low": 0.45, "high": 0.64}) == (
        "+0.250 (intervals disjoint)"
    )
    assert gain(switch, {"pass_at_1": 0.38, "low": 0.29, "high": 0.48}) == (
        "+0.080 (intervals overlap)"
    )
    assert gain(None, switch) == "-"
