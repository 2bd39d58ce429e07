import math

import pytest
import torch

from trainers.losses import clip_fraction, clipped_policy_loss, kl_to_base, nll_loss

LN = math.log


@pytest.mark.parametrize(
    ("ratio", "advantage", "expected"),
    [
        (1.5, 1.0, -1.28),  # above 1 + clip_high with a positive advantage: clipped
        (1.5, -1.0, 1.5),  # negative advantage: the pessimistic, unclipped term
        (0.5, 1.0, -0.5),  # below 1 - clip_low, positive advantage: unclipped
        (0.5, -1.0, 0.8),  # negative advantage: clipped at 0.8
        (1.1, 2.0, -2.2),  # inside the range: plain ratio * advantage
    ],
)
def test_clipped_loss_on_hand_computed_values(ratio, advantage, expected):
    loss = clipped_policy_loss(
        torch.tensor([[LN(ratio)]]),
        torch.zeros(1, 1),
        torch.tensor([[advantage]]),
        torch.ones(1, 1),
        total_tokens=1,
    )
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_mask_and_total_tokens_normalise_and_importance_weights_scale():
    logprobs = torch.zeros(1, 3)
    advantages = torch.tensor([[1.0, 2.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # ratio 1 everywhere: -(1 + 2) over 4 tokens in the whole step
    assert clipped_policy_loss(
        logprobs, logprobs, advantages, mask, total_tokens=4
    ).item() == pytest.approx(-0.75)
    weights = torch.tensor([[0.5, 1.0, 1.0]])
    loss = clipped_policy_loss(logprobs, logprobs, advantages, mask, 4, importance_weights=weights)
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 4)


def test_two_micro_batches_give_the_gradient_of_one_batch():
    torch.manual_seed(0)
    weight = torch.randn(8, requires_grad=True)
    features = torch.randn(4, 6, 8)
    proximal = torch.randn(4, 6) * 0.1 - 1.0
    advantages = torch.randn(4, 6)
    mask = (torch.rand(4, 6) > 0.3).float()
    total = int(mask.sum())

    def loss_of(rows):
        logprobs = -torch.nn.functional.softplus(features[rows] @ weight)
        return clipped_policy_loss(
            logprobs, proximal[rows], advantages[rows], mask[rows], total
        ) + 0.1 * kl_to_base(logprobs, proximal[rows], mask[rows], total)

    (full,) = torch.autograd.grad(loss_of(slice(0, 4)), weight)
    (first,) = torch.autograd.grad(loss_of(slice(0, 2)), weight)
    (second,) = torch.autograd.grad(loss_of(slice(2, 4)), weight)
    assert torch.allclose(first + second, full, atol=1e-6)


def test_kl_estimator_is_zero_at_the_base_and_positive_away_from_it():
    mask = torch.ones(1, 2)
    same = torch.tensor([[-1.0, -2.0]])
    assert kl_to_base(same, same, mask, 2).item() == 0.0
    # d = base - policy = 1 on one token: e - 1 - 1 over 2 tokens
    moved = kl_to_base(torch.tensor([[-2.0, -2.0]]), same, mask, 2).item()
    assert moved == pytest.approx((math.e - 2.0) / 2)


def test_clip_fraction_counts_tokens_outside_the_range():
    logprobs = torch.tensor([[LN(1.5), 0.0, LN(0.5), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert clip_fraction(logprobs, torch.zeros(1, 4), mask) == pytest.approx(2 / 3)


def test_nll_loss_is_the_mean_negative_log_likelihood_of_the_steps_tokens():
    # two rows, the second's last position padding; the step has 4 tokens in all, one of
    # them in another micro-batch: -(ln .5 + ln .25 + ln 1) / 4
    logprobs = torch.tensor([[LN(0.5), LN(0.25)], [0.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss = nll_loss(logprobs, mask, total_tokens=4)
    assert loss.item() == pytest.approx(-(LN(0.5) + LN(0.25)) / 4, abs=1e-6)
