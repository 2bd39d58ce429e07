"""The distillation maths on hand-computed values (trainers/distillation.py)."""

import math

import pytest
import torch

from trainers.distillation import (
    accepted_hints,
    clip_difference,
    select_hint,
    tail_bin_reverse_kl,
    topk_members,
    topk_opd_advantages,
    topk_opd_loss,
    topk_overlap,
)

LOG = math.log


def logs(*probabilities: float) -> torch.Tensor:
    return torch.tensor([LOG(p) for p in probabilities])


def test_the_difference_is_clipped_both_ways_and_none_leaves_it():
    teacher, old = torch.tensor([0.0, -5.0, -1.0]), torch.tensor([-3.0, 0.0, -1.5])
    assert clip_difference(teacher, old, 1.0).tolist() == [1.0, -1.0, 0.5]
    assert clip_difference(teacher, old, None).tolist() == [3.0, -5.0, 0.5]


def test_topk_advantages_are_clipped_differences_weighted_by_the_old_softmax_over_the_set():
    # S_t = two tokens: the old student gives them 0.5 and 0.25 (weights 2/3 and 1/3 over
    # the set), the teacher 0.25 and 0.5: differences -ln 2 and +ln 2, clipped to -/+0.5
    old, teacher = logs(0.5, 0.25), logs(0.25, 0.5)
    advantages = topk_opd_advantages(teacher, old, clip=0.5)
    assert advantages.tolist() == pytest.approx([-0.5 * 2 / 3, 0.5 / 3])
    unclipped = topk_opd_advantages(teacher, old, clip=None)
    assert unclipped.tolist() == pytest.approx([-LOG(2) * 2 / 3, LOG(2) / 3])


def test_an_empty_slot_has_no_weight_and_the_rest_renormalise():
    old, teacher = logs(0.5, 0.25), logs(0.25, 0.5)
    advantages = topk_opd_advantages(teacher, old, clip=0.5, members=torch.tensor([0.0, 1.0]))
    assert advantages.tolist() == pytest.approx([0.0, 0.5])
    none = topk_opd_advantages(teacher, old, clip=0.5, members=torch.tensor([0.0, 0.0]))
    assert none.tolist() == [0.0, 0.0]


def test_topk_loss_at_ratio_one_is_minus_the_summed_advantage_and_its_gradient():
    old = logs(0.5, 0.25).reshape(1, 1, 2)
    advantages = torch.tensor([[[-1 / 3, 1 / 6]]])
    current = old.clone().requires_grad_(True)
    loss = topk_opd_loss(current, old, advantages, torch.ones(1, 1), total_tokens=1)
    assert loss.item() == pytest.approx(1 / 6)
    loss.backward()
    assert current.grad.flatten().tolist() == pytest.approx([1 / 3, -1 / 6])


def test_topk_loss_clips_the_ratio_of_a_member_moved_past_the_range():
    old = torch.zeros(1, 1, 2)
    advantages = torch.tensor([[[1.0, -1.0]]])
    # member 0's ratio e^1 > 1.28 with a positive advantage: clipped, no gradient;
    # member 1's ratio e^-1 < 0.8 with a negative advantage: clipped too
    current = torch.tensor([[[1.0, -1.0]]], requires_grad=True)
    loss = topk_opd_loss(current, old, advantages, torch.ones(1, 1), total_tokens=1)
    assert loss.item() == pytest.approx(-1.28 + 0.8)
    loss.backward()
    assert current.grad.flatten().tolist() == [0.0, 0.0]


def test_two_micro_batches_give_the_gradient_of_one_batch():
    generator = torch.Generator().manual_seed(0)
    old = torch.randn(4, 3, 2, generator=generator)
    advantages = torch.randn(4, 3, 2, generator=generator)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]], dtype=torch.float32)
    total = int(mask.sum())
    whole = (old + 0.1).requires_grad_(True)
    topk_opd_loss(whole, old, advantages, mask, total).backward()
    halves = (old + 0.1).requires_grad_(True)
    for rows in (slice(0, 1), slice(1, 4)):
        topk_opd_loss(halves[rows], old[rows], advantages[rows], mask[rows], total).backward()
    assert torch.allclose(whole.grad, halves.grad, atol=1e-7)


def test_masked_tokens_add_nothing():
    old = torch.zeros(1, 2, 2)
    advantages = torch.tensor([[[1.0, 1.0], [5.0, 5.0]]])
    loss = topk_opd_loss(old.clone(), old, advantages, torch.tensor([[1.0, 0.0]]), 1)
    assert loss.item() == pytest.approx(-2.0)


def test_the_overlap_counts_shared_ids_at_trained_positions():
    student = torch.tensor([[1, 2], [3, 4], [5, 6]])
    teacher = torch.tensor([[2, 9], [4, 3], [5, 6]])
    assert topk_overlap(student, teacher, torch.tensor([1, 1, 0])) == 3
    assert topk_overlap(student, teacher, torch.tensor([1, 1, 1])) == 5


def test_the_subsets_pick_the_student_the_teacher_or_their_overlap():
    student, teacher = torch.tensor([[1, 2, 3]]), torch.tensor([[3, 7, 1]])
    assert topk_members(student, teacher, "student").tolist() == [[1.0, 1.0, 1.0]]
    assert topk_members(student, teacher, "teacher").tolist() == [[1.0, 1.0, 1.0]]
    assert topk_members(student, teacher, "overlap").tolist() == [[1.0, 0.0, 1.0]]
    with pytest.raises(ValueError, match="subset must be one of"):
        topk_members(student, teacher, "both")


def test_hints_are_accepted_on_a_yes_vote_when_long_and_new_at_most_three():
    votes = [
        (1, "Answer in French, please."),
        (0, "Use fewer words in each reply."),
        (1, "short"),
        (1, "Answer  in French,\nplease."),  # the first one again, spaced differently
        (-1, "Mention the price of each item."),
        (1, "Mention the price of each item."),
        (1, "Ask before booking anything."),
        (1, "Keep every answer under fifty words."),
        (1, None),
    ]
    assert accepted_hints(votes) == [
        "Answer in French, please.",
        "Mention the price of each item.",
        "Ask before booking anything.",
    ]


def test_selection_by_overlap_length_or_shortness():
    hints = ["a medium hint", "the longest hint of all", "short hint"]
    assert select_hint(hints, [4, 7, 7], "overlap") == 1  # the first of equals
    assert select_hint(hints, [0, 0, 0], "longest") == 1
    assert select_hint(hints, [0, 0, 0], "shortest") == 2
    assert select_hint([], [], "overlap") is None
    with pytest.raises(ValueError, match="hint selection must be one of"):
        select_hint(hints, [1, 2, 3], "random")
    with pytest.raises(ValueError, match="3 candidates but 2 overlap scores"):
        select_hint(hints, [1, 2], "overlap")


def test_the_tail_bin_kl_on_hand_computed_distributions():
    # student: 0.5, 0.25 on the teacher's top-2 and 0.25 in the tail; teacher: 0.25, 0.5 and
    # 0.25. KL = 0.5 ln 2 + 0.25 ln 0.5 + 0.25 ln 1 = 0.25 ln 2
    student = logs(0.5, 0.25).reshape(1, 1, 2).requires_grad_(True)
    teacher = logs(0.25, 0.5).reshape(1, 1, 2)
    kl = tail_bin_reverse_kl(student, teacher, torch.ones(1, 1), total_tokens=1)
    assert kl.item() == pytest.approx(0.25 * LOG(2), abs=1e-6)
    kl.backward()
    assert student.grad is not None and teacher.grad is None


def test_the_tail_bin_kl_is_zero_for_equal_distributions_and_finite_when_the_set_holds_all():
    same = logs(0.6, 0.3).reshape(1, 1, 2)
    assert tail_bin_reverse_kl(same, same, torch.ones(1, 1), 1).item() == pytest.approx(0.0)
    whole = logs(0.5, 0.5).reshape(1, 1, 2)  # no tail left
    kl = tail_bin_reverse_kl(whole, logs(0.25, 0.5).reshape(1, 1, 2), torch.ones(1, 1), 1)
    # 0.5 ln 2 + 0.5 ln 1 + 0 * (log 0 - ln 0.25) = 0.5 ln 2
    assert kl.item() == pytest.approx(0.5 * LOG(2), abs=1e-5)
