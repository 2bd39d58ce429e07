"""The learner's side of top-k on-policy distillation (`method=topk_opd|topk_combine`).

The loss (`trainers.distillation`) needs, at each completion position t of a hinted turn,
log-probs of the tokens of S_t under three policies:

- old: the policy that sampled the turn. Its top-k ids and log-probs were returned by the
  engine at sampling and stored with the turn (`Turn.completion_top_ids`): not recomputed.
- teacher: the base model with the judge's hint in its prompt. An engine's own top-k of the
  hinted context need not hold the student's ids, so they are read where the full
  distribution exists: one no-grad forward of the learner's own model with the adapter off
  over the hinted prompt followed by the student's completion ids (never re-tokenized),
  gathering the teacher's log-probs at S_t and its own top-k (the teacher and overlap
  subsets). docs/training.md gives what it costs.
- current: the weights being trained, with gradient: gathered at S_t from the log-softmax of
  the learner's ordinary forward (`trainers.logprobs.span_logprobs_at`), no extra pass.

With `subset=teacher`, S_t is the teacher's top-k, at which the engine stored nothing: old
is then the learner's own log-probs before the step (the same weights, on-policy, up to the
engine-learner gap). The ratio of PPO's surrogate is taken, like the learner's policy loss,
against the weights before the step (`trainers.learner` says why): 1 in its one update a
step, so each member's gradient is -A_v times that of its log-prob, the student-weighted
reverse-KL gradient on S_t.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainers.distillation import (
    tail_bin_reverse_kl,
    topk_members,
    topk_opd_advantages,
    topk_opd_loss,
)
from trainers.learning import TrainSample
from trainers.logprobs import padded_states


@dataclass(frozen=True)
class TopKSettings:
    """The top-k term of a learner's loss (from `method`)."""

    k: int = 4
    subset: str = "student"
    clip: float | None = 1.0
    weight: float = 1.0
    """w_opd: the term's weight beside the policy loss."""
    loss: str = "topk_opd"
    """topk_opd (the clipped surrogate over S_t), or oel: reverse KL(student || teacher)
    over the teacher's top-k plus a tail bin (`tail_bin_reverse_kl`; `subset=teacher`)."""


@dataclass(frozen=True)
class TeacherTopK:
    """The hinted teacher at one sample's completion positions, each [tokens, k]."""

    at_student: torch.Tensor
    """Its log-probs of the old student's top-k ids."""
    ids: torch.Tensor
    """Its own top-k ids, likeliest first."""
    logprobs: torch.Tensor
    """Their log-probs."""


def teacher_topk(
    causal_lm: Any, samples: Sequence[TrainSample], k: int, chunk: int
) -> list[TeacherTopK | None]:
    """The teacher's log-probs of each hinted sample (None for the others), from one pass
    over their hinted prompts + completions (right-padded; call it with the adapter off
    and without gradient). The vocabulary projection runs `chunk` positions at a time."""
    hinted = [i for i, s in enumerate(samples) if s.teacher_prompt_ids is not None]
    found: list[TeacherTopK | None] = [None] * len(samples)
    if not hinted:
        return found
    sequences = [
        [*(samples[i].teacher_prompt_ids or ()), *samples[i].completion_ids] for i in hinted
    ]
    hidden = padded_states(causal_lm, sequences)
    device = hidden.device
    head = causal_lm.get_output_embeddings()
    for row, index in enumerate(hinted):
        sample = samples[index]
        start, end = len(sample.teacher_prompt_ids or ()), len(sequences[row])
        # oel keeps no student top-k: its term reads the teacher's own top-k alone
        student = torch.zeros(len(sample.completion_ids), 0, dtype=torch.long, device=device)
        if sample.top_ids:
            student = torch.tensor(sample.top_ids, dtype=torch.long, device=device)
        pieces = []
        for i in range(start, end, chunk):
            stop = min(i + chunk, end)
            logsoftmax = torch.log_softmax(head(hidden[row, i - 1 : stop - 1]).float(), dim=-1)
            top = logsoftmax.topk(k, dim=-1)
            at = logsoftmax.gather(-1, student[i - start : stop - start])
            pieces.append((at, top.indices, top.values))
        found[index] = TeacherTopK(*(torch.cat(parts) for parts in zip(*pieces, strict=True)))
    return found


def set_ids(sample: TrainSample, teacher: TeacherTopK | None, subset: str) -> torch.Tensor | None:
    """The ids of S_t at each position ([tokens, k]) whose current log-probs the learner's
    forward gathers; None for a sample without the top-k term."""
    if teacher is None:
        return None
    if subset == "teacher":
        return teacher.ids.cpu()
    return torch.tensor(sample.top_ids, dtype=torch.long)


def topk_loss(
    samples: Sequence[TrainSample],
    current: Sequence[torch.Tensor | None],
    teachers: Sequence[TeacherTopK | None],
    settings: TopKSettings,
    total_tokens: int,
) -> torch.Tensor | None:
    """w_opd * the top-k OPD loss of a micro-batch's samples, normalised by the step's
    token count (so that micro-batches add up to the batch); None when none has the term.

    Args:
        current: each sample's current log-probs at `set_ids` ([tokens, k], with gradient).
        teachers: each sample's `teacher_topk`.
    """
    losses = []
    for sample, now, teacher in zip(samples, current, teachers, strict=True):
        if now is None or teacher is None:
            continue
        device = now.device
        if settings.loss == "oel":
            mask = torch.ones(len(sample.completion_ids), device=device)
            teacher_logprobs = teacher.logprobs.to(device)
            losses.append(tail_bin_reverse_kl(now, teacher_logprobs, mask, total_tokens))
            continue
        student_ids = torch.tensor(sample.top_ids, dtype=torch.long, device=device)
        if settings.subset == "teacher":
            teacher_at, old = teacher.logprobs.to(device), now.detach()
            members = None
        else:
            teacher_at = teacher.at_student.to(device)
            old = torch.tensor(sample.top_logprobs, dtype=now.dtype, device=device)
            members = topk_members(student_ids, teacher.ids.to(device), settings.subset)
            members = members.to(device)
        advantages = topk_opd_advantages(teacher_at, old, settings.clip, members)
        mask = torch.ones(len(sample.completion_ids), device=device)
        losses.append(topk_opd_loss(now, now.detach(), advantages, mask, total_tokens))
    return settings.weight * torch.stack(losses).sum() if losses else None
