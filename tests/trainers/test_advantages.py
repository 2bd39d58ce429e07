import pytest
import torch

from trainers.advantages import (
    combine_advantages,
    group_baseline,
    is_stale,
    mix_rewards,
    opd_advantages,
    truncated_importance_weights,
)


def test_group_baseline_subtracts_the_group_mean_and_leaves_singletons():
    rewards = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0])
    groups = ["a", "a", "a", "b", "c"]
    # group a: mean 1/3 -> 2/3, -4/3, 2/3; b and c alone keep their reward
    expected = torch.tensor([2 / 3, -4 / 3, 2 / 3, 1.0, -1.0])
    assert torch.allclose(group_baseline(rewards, groups), expected)


def test_group_baseline_can_scale_by_the_group_std():
    # group of 1, 0: mean 0.5, population std 0.5 -> +1, -1
    scaled = group_baseline(torch.tensor([1.0, 0.0]), ["g", "g"], scale_by_std=True)
    assert torch.allclose(scaled, torch.tensor([1.0, -1.0]), atol=1e-5)


def test_uniform_group_has_zero_advantage():
    assert torch.equal(group_baseline(torch.tensor([1.0, 1.0]), [0, 0]), torch.zeros(2))


@pytest.mark.parametrize("size", [3, 6, 7, 8])
@pytest.mark.parametrize("scale_by_std", [False, True])
def test_a_uniform_group_of_any_reward_centres_to_exactly_zero(size, scale_by_std):
    # a float32 mean of 0.3s is off by 3e-8, which dividing by the std made 0.03
    rewards = torch.full((size,), 0.3)
    centred = group_baseline(rewards, ["g"] * size, scale_by_std)
    assert torch.equal(centred, torch.zeros(size))


@pytest.mark.parametrize(
    ("judge", "env", "expected"),
    [
        (1.0, None, 1.0),
        (-1.0, None, -1.0),
        (0.0, None, None),
        (None, None, None),
        (None, 0.0, 0.0),
        (0.0, -1.0, -1.0),
        (1.0, 1.0, 2.0),
    ],
)
def test_mix_rewards_treats_a_judge_tie_as_no_signal_but_keeps_env_zero(judge, env, expected):
    assert mix_rewards(judge, env) == expected


def test_opd_advantage_is_teacher_minus_rollout():
    teacher = torch.tensor([-0.5, -2.0, -0.1])
    rollout = torch.tensor([-1.0, -1.0, -0.1])
    assert torch.allclose(opd_advantages(teacher, rollout), torch.tensor([0.5, -1.0, 0.0]))


ROLLOUT = torch.tensor([-1.0, -2.0])
TEACHER = torch.tensor([-0.5, -3.0])


@pytest.mark.parametrize(
    ("teacher", "score", "expected"),
    [
        (TEACHER, 1.0, [1.5, 0.0]),  # hint, +1: (0.5, -1) + 1
        (TEACHER, -1.0, [-0.5, -2.0]),  # hint, -1: (0.5, -1) - 1
        (TEACHER, 0.0, [0.5, -1.0]),  # hint, 0: teacher term only
        (None, 1.0, [1.0, 1.0]),  # no hint, +1: reward on every token
        (None, -1.0, [-1.0, -1.0]),
        (None, 0.0, None),  # no hint, 0: dropped
    ],
)
def test_combine_follows_the_dispatch_table(teacher, score, expected):
    result = combine_advantages(ROLLOUT, teacher, score)
    if expected is None:
        assert result is None
    else:
        assert torch.allclose(result, torch.tensor(expected))


def test_combine_weights_scale_each_term():
    result = combine_advantages(ROLLOUT, TEACHER, 1.0, w_opd=2.0, w_rl=0.5)
    assert torch.allclose(result, torch.tensor([2 * 0.5 + 0.5, 2 * -1.0 + 0.5]))


def test_truncated_importance_weights_are_one_on_policy_and_capped():
    prox = torch.tensor([-1.0, -1.0, -1.0])
    rollout = torch.tensor([-1.0, -1.0 + torch.log(torch.tensor(2.0)).item(), -5.0])
    weights = truncated_importance_weights(prox, rollout, cap=2.0)
    assert torch.allclose(weights, torch.tensor([1.0, 0.5, 2.0]))


@pytest.mark.parametrize(
    ("version", "current", "stale"), [(5, 5, False), (3, 5, False), (2, 5, True)]
)
def test_staleness_counts_versions_behind(version, current, stale):
    assert is_stale(version, current, max_staleness=2) is stale


def test_diff_clip_bounds_the_teacher_term_of_opd_and_combine_only():
    teacher, rollout = torch.tensor([-0.5, -6.0, 0.0]), torch.tensor([-4.0, -1.0, -0.25])
    assert opd_advantages(teacher, rollout, clip=1.0).tolist() == [1.0, -1.0, 0.25]
    assert opd_advantages(teacher, rollout).tolist() == [3.5, -5.0, 0.25]
    combined = combine_advantages(rollout, teacher, -1.0, w_opd=2.0, clip=1.0)
    assert combined.tolist() == [2 * 1.0 - 1, 2 * -1.0 - 1, 2 * 0.25 - 1]
