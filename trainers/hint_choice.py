"""Choosing among a turn's hint candidates by top-k overlap (`judge.hint_selection=overlap`).

The judge accepts up to three hints a turn; where it accepted several, the learner chooses,
because the choice needs full next-token distributions, which only its own forward passes
give (an engine returns the log-prob of a given token, not a distribution):

- the teacher: the base model (adapter off) with each candidate appended to the last user
  message (`trainers.judge.with_hint`), one no-grad pass over every candidate's hinted prompt
  followed by the student's own completion ids (never re-tokenized): its top-k ids at each
  completion position, and its log-probs of the sampled tokens;
- the student: the old student's top-k as the engine stored them with the turn (the top-k
  methods keep them), else the learner's own no-grad pass with the adapter on, at the same
  ids.

Overlap O[h] = sum over the turn's tokens t of |student top-k at t intersect teacher-with-h
top-k at t| (`trainers.distillation.topk_overlap`); the largest wins, the first among
equals. The chosen hint's teacher log-probs of the sampled tokens are the OPD teacher's
(`Judgement.teacher_logprobs`), from the same pass. Cost: one forward over (candidates x
(hinted prompt + completion)) tokens per turn with several candidates, plus one over the
turn without stored top-k; no backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from agents.engines.base import Engine
from agents.trajectory import Judgement, Turn
from agents.vision import PixelInputs, Pixels, images_of
from trainers.distillation import select_hint, topk_overlap
from trainers.judge import teacher_logprobs, with_hint
from trainers.logprobs import padded_states, vision_head, vision_states
from trainers.lora import release_openmp_workers
from trainers.samples import Encode


@dataclasses.dataclass(frozen=True)
class Scored:
    """One context's view of a completion: top-k ids and the sampled tokens' log-probs."""

    top_ids: torch.Tensor
    """[tokens, k], likeliest first."""
    sampled: torch.Tensor
    """[tokens], the log-probs of the completion's own ids."""


def score_contexts(
    causal_lm: Any,
    prompts: Sequence[Sequence[int]],
    completion: Sequence[int],
    k: int,
    chunk: int,
    pixels: PixelInputs | None = None,
) -> list[Scored]:
    """Each prompt's top-k and sampled-token log-probs at the completion's positions, from
    one right-padded pass (call it without gradient); the vocabulary projection runs
    `chunk` positions at a time. With `pixels` (a vision-language model's prompts, which
    share their images), a pass per prompt with them, markup tokens masked as the engine
    samples (`trainers.logprobs.vision_states`)."""
    sequences = [[*prompt, *completion] for prompt in prompts]
    if pixels is None:
        hidden: Sequence[torch.Tensor] = padded_states(causal_lm, sequences)
        head = causal_lm.get_output_embeddings()
    else:
        hidden = [vision_states(causal_lm, sequence, pixels) for sequence in sequences]
        head = vision_head(causal_lm)
    scored = []
    for row, prompt in enumerate(prompts):
        tops, sampled = [], []
        for start in range(len(prompt), len(sequences[row]), chunk):
            stop = min(start + chunk, len(sequences[row]))
            logits = head(hidden[row][start - 1 : stop - 1]).float()
            logsoftmax = torch.log_softmax(logits, dim=-1)
            tops.append(logsoftmax.topk(k, dim=-1).indices.cpu())
            taken = torch.tensor(sequences[row][start:stop], device=logits.device)
            sampled.append(logsoftmax.gather(-1, taken[:, None])[:, 0].cpu())
        scored.append(Scored(torch.cat(tops), torch.cat(sampled)))
    return scored


def overlaps(student_ids: torch.Tensor, teachers: Sequence[torch.Tensor]) -> list[int]:
    """Each teacher's overlap with the student over every token (`topk_overlap`)."""
    every = torch.ones(len(student_ids))
    return [topk_overlap(student_ids, teacher, every) for teacher in teachers]


def chosen_judgement(
    judgement: Judgement, scores: Sequence[int], teachers: Sequence[Scored]
) -> Judgement:
    """The judgement with the candidate of the largest score as its hint (the first among
    equals), that candidate's teacher log-probs of the sampled tokens, and every score."""
    index = select_hint(judgement.hint_candidates, scores, "overlap")
    if index is None:
        raise ValueError("no hint candidate to choose")
    return dataclasses.replace(
        judgement,
        hint=judgement.hint_candidates[index],
        teacher_logprobs=tuple(teachers[index].sampled.tolist()),
        hint_overlaps=tuple(scores),
    )


class HintChooser:
    """Chooses among turns' hint candidates with the local learner's model.

    Args:
        model: the learner's peft model (its adapter on is the student, off the teacher).
        encode: the engine's `encode`, which rendered the turn's own prompt.
        k: the size of both top-k sets (`judge.overlap_k`).
        chunk: positions a vocabulary projection takes at once (`trainer.logprob_chunk`).
        pixels: a vision-language model's image processor (the learner's), else None.
    """

    def __init__(
        self, model: Any, encode: Encode, k: int, chunk: int, pixels: Pixels | None = None
    ):
        self.model, self.encode, self.k, self.chunk = model, encode, k, chunk
        self.pixels = pixels

    def choose(self, turn: Turn) -> Judgement:
        """The turn's judgement with a hint chosen among its candidates by overlap."""
        judgement = turn.judgement
        if judgement is None or not judgement.awaits_hint_choice:
            raise ValueError(f"turn {turn.session_id}/{turn.index} has no hint choice to make")
        prompts = [
            self.encode(with_hint(turn.prompt_messages, hint), turn.tools or None)
            for hint in judgement.hint_candidates
        ]
        completion = turn.completion_token_ids
        causal_lm = self.model.get_base_model()
        pixels = self._pixels(turn)
        try:
            with torch.no_grad():
                with self.model.disable_adapter():
                    teachers = score_contexts(
                        causal_lm, prompts, completion, self.k, self.chunk, pixels
                    )
                student = self._student(turn, causal_lm, pixels)
        finally:  # the judge's thread lives on beside the engine
            release_openmp_workers()
        scores = overlaps(student, [t.top_ids for t in teachers])
        return chosen_judgement(judgement, scores, teachers)

    def _pixels(self, turn: Turn) -> PixelInputs | None:
        """The pixels of the turn's screenshots (a hint adds text only: every candidate's
        prompt holds the same images)."""
        images = images_of(turn.prompt_messages, None)
        if images and self.pixels is None:
            raise ValueError(f"turn {turn.session_id}/{turn.index} has images; the model none")
        return self.pixels(images) if self.pixels is not None else None

    def _student(self, turn: Turn, causal_lm: Any, pixels: PixelInputs | None) -> torch.Tensor:
        """The old student's top-k ids as stored, else the current adapter's."""
        stored = turn.completion_top_ids
        if stored and len(stored[0]) >= self.k:
            return torch.tensor([ids[: self.k] for ids in stored], dtype=torch.long)
        prompt = turn.prompt_token_ids
        completion = turn.completion_token_ids
        return score_contexts(causal_lm, [prompt], completion, self.k, self.chunk, pixels)[
            0
        ].top_ids


def longest_hint(teacher: Engine, turn: Turn) -> Judgement:
    """A learner without full logits (Tinker) chooses the longest candidate, its teacher
    log-probs scored by the engine (adapter off)."""
    judgement = turn.judgement or Judgement()
    index = select_hint(judgement.hint_candidates, (), "longest")
    if index is None:
        raise ValueError(f"turn {turn.session_id}/{turn.index} has no hint candidate")
    hint = judgement.hint_candidates[index]
    return dataclasses.replace(
        judgement, hint=hint, teacher_logprobs=teacher_logprobs(teacher, turn, hint)
    )
