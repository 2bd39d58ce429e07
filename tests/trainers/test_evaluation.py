"""Held-out evaluation across a resume: the evaluations recorded in metrics.jsonl come back,
and a step already evaluated is not played again."""

import dataclasses

import pytest

from agents.compose import env_factory
from agents.config import EnvConfig, SamplingConfig
from agents.rollout import EpisodeSummary
from agents.trajectory import SessionStatus
from trainers import evaluation
from trainers.config import EvalConfig
from trainers.evaluation import EvalScore, Evaluator, eval_row, score_of
from trainers.metrics import MetricsWriter, read_metrics, record


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
    assert [step for step, _ in held_out["curve"]] == [0, 2]


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
