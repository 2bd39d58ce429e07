"""Tinker's losses on hand-computed values, and the datum checks."""

import math

import numpy as np
import pytest
import torch

from trainers.tinker.errors import UserError
from trainers.tinker.losses import check_datum, check_loss_config, tinker_loss
from trainers.tinker.wire import Datum

LOGPROBS = torch.tensor([math.log(0.5), math.log(0.25)])
SAMPLED = torch.tensor([math.log(0.25), math.log(0.5)])  # ratios 2 and 0.5
ADVANTAGES = torch.tensor([1.0, -2.0])


def test_cross_entropy_is_the_weighted_negative_logprob():
    loss = tinker_loss("cross_entropy", LOGPROBS, {"weights": torch.tensor([1.0, 0.0])}, {})
    assert loss.tolist() == pytest.approx([math.log(2), 0.0])


def test_importance_sampling_weights_the_advantage_by_the_ratio():
    inputs = {"logprobs": SAMPLED, "advantages": ADVANTAGES}
    assert tinker_loss("importance_sampling", LOGPROBS, inputs, {}).tolist() == pytest.approx(
        [-2.0, 1.0]
    )


def test_ppo_clips_the_ratio():
    inputs = {"logprobs": SAMPLED, "advantages": ADVANTAGES}
    # ratio 2 clipped to 1.2 for A=1; ratio 0.5 with A=-2: min(-1, -1.6) = -1.6
    assert tinker_loss("ppo", LOGPROBS, inputs, {}).tolist() == pytest.approx([-1.2, 1.6])
    wide = {"clip_low_threshold": 0.1, "clip_high_threshold": 3.0}
    assert tinker_loss("ppo", LOGPROBS, inputs, wide).tolist() == pytest.approx([-2.0, 1.0])


def test_cispo_weights_the_logprob_by_the_clipped_ratio_held_constant():
    logprobs = LOGPROBS.clone().requires_grad_()
    inputs = {"logprobs": SAMPLED, "advantages": ADVANTAGES}
    # default clip [0, 4] keeps ratios 2 and 0.5: -2 * ln(1/2) * 1, -0.5 * ln(1/4) * -2
    loss = tinker_loss("cispo", logprobs, inputs, {})
    assert loss.tolist() == pytest.approx([2 * math.log(2), -2 * math.log(2)])
    loss.sum().backward()
    assert logprobs.grad.tolist() == pytest.approx([-2.0, 1.0])  # -clip(ratio) * A, no more
    narrow = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert tinker_loss("cispo", LOGPROBS, inputs, narrow).tolist() == pytest.approx(
        [1.2 * math.log(2), -3.2 * math.log(2)]
    )


def test_dro_is_the_advantage_weighted_logprob_less_a_quadratic_penalty():
    inputs = {"logprobs": SAMPLED, "advantages": ADVANTAGES}
    penalty = 0.5 * 0.05 * math.log(2) ** 2  # log-ratios +-ln 2, beta 0.05 by default
    assert tinker_loss("dro", LOGPROBS, inputs, {}).tolist() == pytest.approx(
        [math.log(2) + penalty, -4 * math.log(2) + penalty]
    )
    strong = tinker_loss("dro", LOGPROBS, inputs, {"beta": 1.0}).tolist()
    assert strong == pytest.approx([math.log(2) + penalty * 20, -4 * math.log(2) + penalty * 20])


def test_loss_config_takes_only_the_loss_own_numbers():
    check_loss_config("ppo", {"clip_low_threshold": 0.5})
    check_loss_config("importance_sampling", None)
    with pytest.raises(UserError, match="takes no loss_fn_config 'clip_hi'"):
        check_loss_config("cispo", {"clip_hi": 2.0})
    with pytest.raises(UserError, match="must be a number"):
        check_loss_config("dro", {"beta": "0.1"})
    with pytest.raises(UserError, match="importance_sampling takes no"):
        check_loss_config("importance_sampling", {"beta": 0.1})


def test_summed_losses_of_two_chunks_give_one_batch_gradient():
    weights = torch.zeros(2, requires_grad=True)
    inputs = {"logprobs": SAMPLED, "advantages": ADVANTAGES}
    tinker_loss("importance_sampling", LOGPROBS + weights, inputs, {}).sum().backward()
    whole = weights.grad.clone()
    weights.grad = None
    for i in range(2):
        part = {k: v[i : i + 1] for k, v in inputs.items()}
        tinker_loss("importance_sampling", (LOGPROBS + weights)[i : i + 1], part, {}).backward()
    assert weights.grad.tolist() == pytest.approx(whole.tolist())


def test_datum_checks_name_the_problem():
    targets = np.array([2, 3], dtype=np.int64)
    with pytest.raises(UserError, match="needs loss_fn_inputs"):
        check_datum(Datum((1, 2), {"target_tokens": targets}), 0, "ppo", 100)
    with pytest.raises(UserError, match="outside the vocabulary"):
        check_datum(Datum((1, 200), {"target_tokens": targets}), 0, "cross_entropy", 100)
    with pytest.raises(UserError, match="shape"):
        check_datum(Datum((1, 2, 3), {"target_tokens": targets}), 0, "cross_entropy", 100)
    tokens, inputs = check_datum(Datum((1, 2), {"target_tokens": targets}), 0, "cross_entropy", 9)
    assert tokens.tolist() == [1, 2] and inputs["target_tokens"].dtype == torch.long
