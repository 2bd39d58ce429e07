"""The maths of distillation from a hinted or experienced teacher: pure functions of tensors.

OpenClaw-RL's 2026 methods, each in a few lines:

- Top-k on-policy distillation. At each response position t, S_t is a set of k tokens (the
  old student's top-k by default). For v in S_t the advantage is the teacher-minus-old
  log-prob difference, clipped to [-c, c], weighted by the old student's softmax over S_t;
  the loss is PPO's clipped surrogate of each v's ratio, summed over S_t. Log-probs are the
  full vocabulary's, never renormalised over S_t: the set only picks which tokens enter.
- Hint candidates chosen by overlap: the hint whose teacher top-k agrees most with the
  student's top-k over the turn's tokens.
- Experience distillation (OEL): reverse KL(student || teacher) over the teacher's top-k
  tokens plus one tail bin holding the rest of each distribution's mass.

Shapes: `[..., T]` per token, `[..., T, k]` per token and set member, with a 0/1 `mask` over
tokens. Every loss is a sum divided by `total_tokens`, the trained tokens of the whole
optimiser step, so micro-batches' gradients add up to the full batch's (`trainers/losses.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

HINT_SELECTIONS = ("overlap", "longest", "shortest")
TOPK_SUBSETS = ("student", "teacher", "overlap")


def clip_difference(
    teacher_logprobs: torch.Tensor, old_logprobs: torch.Tensor, clip: float | None
) -> torch.Tensor:
    """teacher - old, clamped to [-clip, clip] (None: unclipped). One confident teacher token
    (a difference of 10 nats) would otherwise outweigh a whole turn of agreement."""
    difference = teacher_logprobs - old_logprobs
    return difference if clip is None else difference.clamp(-clip, clip)


def topk_opd_advantages(
    teacher_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    clip: float | None = 1.0,
    members: torch.Tensor | None = None,
) -> torch.Tensor:
    """A_v = clip(teacher(v) - old(v), -c, c) * softmax_{S_t}(old)(v), for v in S_t.

    Args:
        teacher_logprobs: [..., T, k] the teacher's full-vocabulary log-probs of S_t's tokens.
        old_logprobs: [..., T, k] the old student's log-probs of the same tokens.
        clip: c; None leaves the difference unclipped.
        members: [..., T, k] 1 where the slot holds a member of S_t, 0 where a smaller set
            (the overlap subset) left it empty; None: every slot is a member.

    Returns the advantages, [..., T, k], with no gradient.
    """
    old = old_logprobs.detach()
    if members is not None:
        old = old.masked_fill(members == 0, float("-inf"))
    weights = torch.softmax(old, dim=-1).nan_to_num(0.0)  # an empty set has no weight
    difference = clip_difference(teacher_logprobs.detach(), old_logprobs.detach(), clip)
    return (difference * weights).detach()


def topk_opd_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    total_tokens: int,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> torch.Tensor:
    """PPO's clipped surrogate for each member of S_t, summed over the set, then over the
    trained tokens, divided by the step's token count.

    Args:
        logprobs: [..., T, k] the trained weights' log-probs of S_t's tokens.
        old_logprobs: [..., T, k] the same under the policy that sampled (no grad).
        advantages: [..., T, k] from `topk_opd_advantages` (0 in empty slots).
        mask: [..., T] 1 for trained tokens.
        total_tokens: trained tokens in the whole step.
        clip_low, clip_high: the ratio is kept in [1 - clip_low, 1 + clip_high].
    """
    ratio = torch.exp(logprobs - old_logprobs.detach())
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_member = -torch.minimum(ratio * advantages, clipped * advantages)
    return (per_member.sum(-1) * mask).sum() / max(total_tokens, 1)


def topk_members(student_ids: torch.Tensor, teacher_ids: torch.Tensor, subset: str) -> torch.Tensor:
    """Which slots of the student's top-k ids form S_t: every slot (`student`), or those the
    teacher's top-k holds too (`overlap`). `teacher` takes the teacher's ids as the set
    instead, every slot a member; this returns its mask over `teacher_ids`.

    Args:
        student_ids, teacher_ids: [..., T, k] token ids.
    """
    if subset not in TOPK_SUBSETS:
        raise ValueError(f"subset must be one of {TOPK_SUBSETS}, got {subset!r}")
    if subset == "overlap":
        shared = (student_ids.unsqueeze(-1) == teacher_ids.unsqueeze(-2)).any(-1)
        return shared.to(torch.float32)
    ids = teacher_ids if subset == "teacher" else student_ids
    return torch.ones(ids.shape, dtype=torch.float32)


def topk_overlap(student_ids: torch.Tensor, teacher_ids: torch.Tensor, mask: torch.Tensor) -> int:
    """sum over trained positions t of |student top-k at t intersect teacher top-k at t|.

    Args:
        student_ids, teacher_ids: [T, k] token ids (the top-k of each position).
        mask: [T] 1 for the turn's trained tokens.
    """
    shared = (student_ids.unsqueeze(-1) == teacher_ids.unsqueeze(-2)).any(-1).sum(-1)
    return int((shared * mask.to(shared.dtype)).sum())


def accepted_hints(
    votes: Sequence[tuple[int | None, str | None]], min_chars: int = 10, most: int = 3
) -> list[str]:
    """The hint candidates of a turn's judge samples, in sampling order: a +1 vote with a hint
    over `min_chars` characters, not a duplicate of an earlier one (whitespace aside), at most
    `most` of them."""
    chosen: list[str] = []
    for vote, hint in votes:
        text = " ".join((hint or "").split())
        if vote == 1 and len(text) > min_chars and text not in chosen:
            chosen.append(text)
    return chosen[:most]


def select_hint(candidates: Sequence[str], overlaps: Sequence[int], selection: str) -> int | None:
    """The index of the chosen candidate: the largest overlap (the first among equals), the
    longest or the shortest hint; None when there is no candidate."""
    if selection not in HINT_SELECTIONS:
        raise ValueError(f"hint selection must be one of {HINT_SELECTIONS}, got {selection!r}")
    if not candidates:
        return None
    if selection == "overlap":
        if len(overlaps) != len(candidates):
            raise ValueError(f"{len(candidates)} candidates but {len(overlaps)} overlap scores")
        keys: Sequence[float] = overlaps
    else:
        sign = 1 if selection == "longest" else -1
        keys = [sign * len(c) for c in candidates]
    return max(range(len(candidates)), key=lambda i: (keys[i], -i))


def log1mexp(log_mass: torch.Tensor, floor: float = 1e-12) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, the log of the mass left outside a set; floored so that a
    set holding (numerically) all the mass leaves a tiny tail rather than log 0."""
    return torch.log((-torch.expm1(log_mass.clamp(max=0.0))).clamp(min=floor))


def tail_bin_reverse_kl(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    total_tokens: int,
) -> torch.Tensor:
    """KL(student || teacher) over the teacher's top-k tokens plus one tail bin (OEL).

    Each distribution is read at the teacher's top-k ids, and everything else collapses into
    one bin of mass 1 - sum: the divergence of the two (k + 1)-bin distributions, per token.
    The gradient reaches the student alone.

    Args:
        student_logprobs: [..., T, k] the student's full-vocabulary log-probs at the ids.
        teacher_logprobs: [..., T, k] the teacher's at the same ids (its top-k).
        mask: [..., T] 1 for trained tokens.
        total_tokens: trained tokens in the whole step.
    """
    teacher = teacher_logprobs.detach()
    student_tail = log1mexp(torch.logsumexp(student_logprobs, dim=-1))
    teacher_tail = log1mexp(torch.logsumexp(teacher, dim=-1))
    inside = (student_logprobs.exp() * (student_logprobs - teacher)).sum(-1)
    tail = student_tail.exp() * (student_tail - teacher_tail)
    return ((inside + tail) * mask).sum() / max(total_tokens, 1)
