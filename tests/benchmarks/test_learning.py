"""The learning benchmark's comparison: its statistics on hand-computed values, and its
smallest configuration run end to end on the tiny model."""

import json

import pytest

from benchmarks import learning
from benchmarks.learning_report import guarded_scores, step_scores, task_means


def _run(method, seed, held_out, training=()):
    return {
        "method": method,
        "seed": seed,
        "wall_s": 1.0,
        "held_out": [{"step": s, "scores": v, "on_topic": t} for s, v, t in held_out],
        "training": [{"step": s, "entropy": e, "kl_to_start": k} for s, e, k in training],
    }


def test_task_means_average_each_task_over_the_seeds():
    assert task_means([[0.0, 1.0, 0.5], [1.0, 1.0, 0.0]]) == [0.5, 1.0, 0.25]
    assert guarded_scores([0.5, 1.0], [True, False]) == [0.5, 0.0]
    with pytest.raises(ValueError, match="different task counts"):
        task_means([[0.0], [1.0, 1.0]])


def test_step_scores_pair_each_method_with_the_first_task_by_task():
    both, neither = [True, True], [False, False]
    runs = [
        _run("combine", 0, [(0, [0.0, 0.5], both), (2, [0.5, 0.5], both)], [(2, 7.0, 0.01)]),
        _run("combine", 1, [(0, [0.0, 0.5], both), (2, [0.5, 1.0], both)], [(2, 6.0, 0.03)]),
        # oel's seed 1 was not scored at step 2: that step has no like-for-like figure
        _run("oel", 0, [(0, [0.0, 0.5], both), (2, [1.0, 1.0], [True, False])]),
        _run("oel", 1, [(0, [0.0, 0.5], neither)]),
    ]
    scores = {(s.method, s.step): s for s in step_scores(runs, ["combine", "oel"])}
    assert set(scores) == {("combine", 0), ("combine", 2), ("oel", 0)}
    at_two = scores["combine", 2]
    assert (at_two.seeds, at_two.score, at_two.on_topic) == (2, 0.625, 1.0)  # tasks 0.5, 0.75
    assert (at_two.entropy, at_two.kl_to_start) == (6.5, 0.02)
    assert at_two.difference is None and at_two.low <= 0.625 <= at_two.high
    start = scores["oel", 0]
    assert start.entropy is None  # no training at step 0
    assert (start.on_topic, start.guarded) == (0.5, 0.125)  # seed 1 off topic: 0.25 / 2 tasks
    assert (start.difference, start.difference_low, start.difference_high) == (0.0, 0.0, 0.0)


def test_scored_steps_are_every_nth_and_the_last():
    assert learning.scored_steps(10, 4) == [4, 8, 10]
    assert learning.scored_steps(3, 0) == [3]


def test_a_method_is_configured_as_its_group_composes_it():
    assert learning.method_config("topk_opd").w_rl == 0.0
    assert learning.method_config("oel").teacher_k == 50
    with pytest.raises(ValueError, match="unknown method 'ppo'"):
        learning.method_config("ppo")


@pytest.mark.slow  # 35-50 s on 2 shared cores: three training runs
def test_the_smallest_comparison_trains_scores_and_keeps_each_run(tmp_path):
    """The default methods (combine, topk_combine, oel) one step each on tiny (the persona
    tiny's noise never pleases, so every turn is a complaint with a hint), scored before and
    after; run again, nothing is redone."""
    argv = [
        *("--model", "tiny", "--persona", "spanish", "--steps", "1", "--seeds", "0"),
        *("--batch-turns", "2", "--group-size", "2", "--max-tokens", "4"),
        *("--eval-tasks", "2", "--eval-max-tokens", "4", "--experience-max-tokens", "4"),
        *("--speedup-steps", "0", "--out", str(tmp_path)),
    ]
    learning.main(argv)
    runs = json.loads((tmp_path / "learning.json").read_text())
    assert [(r["method"], [h["step"] for h in r["held_out"]]) for r in runs] == [
        (m, [0, 1]) for m in ("combine", "topk_combine", "oel")
    ]
    distilled = {r["method"]: r["training"][0]["distill_tokens"] for r in runs}
    assert distilled["combine"] == 0 and distilled["topk_combine"] > 0 and distilled["oel"] > 0
    assert all(r["training"][0]["entropy"] > 0 for r in runs)
    assert (tmp_path / "learning.png").stat().st_size > 0
    (tmp_path / "learning.json").unlink()
    learning.main(argv)  # every run's record is kept: read back, not trained or scored again
    assert json.loads((tmp_path / "learning.json").read_text()) == runs
