"""The judge's typed config (`judge=` in `python -m trainers.run`; trainers/judge.py builds
the judge from it), apart from the run's other sections in `trainers.config`.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainers.distillation import HINT_SELECTIONS


@dataclass
class JudgeConfig:
    """Who scores turns and writes hints (trainers/judge.py)."""

    kind: str = "self"
    """self (the policy's base model), remote (an OpenAI-compatible URL), env (the
    environment's outcome), feedback (a phrase lexicon reading the user's reply; for
    machines without a capable judge model), or a custom judge as `module:Class`."""
    votes: int = 3
    """m: samples per turn for the score, and again for the hint."""
    decoding: str = "guided"
    """guided: votes are sampled from the judge model's probabilities of the valid answers
    (every vote valid, three short scoring passes), hints written as plain text after a
    guided yes; free: the judge writes its reasoning and answer, parsed as OpenClaw-RL does."""
    temperature: float = 0.6
    """Sampling temperature of the votes."""
    max_tokens: int = 128
    """Tokens per judge answer."""
    score_template: str = "judge_score"
    """Score prompt: a file path, or a name in trainers/prompts/."""
    hint_template: str = "judge_hint"
    """Hint prompt: a file path, or a name in trainers/prompts/."""
    hint_text_template: str = "judge_hint_text"
    """guided decoding: the prompt that asks for the hint alone, after a guided yes."""
    hint_min_chars: int = 10
    """Hints of this many characters or fewer are rejected."""
    hint_selection: str = "overlap"
    """Which of a turn's accepted hints (up to 3: a yes vote, long enough, no duplicate) the
    teacher takes: overlap (the one whose hinted teacher's top-k tokens agree most with the
    student's over the turn, scored by the local learner), longest or shortest."""
    overlap_k: int = 4
    """hint_selection=overlap: the k of both top-k sets."""
    base_url: str | None = None
    """remote judge: the OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1."""
    api_key: str | None = None
    """remote judge: its API key."""
    model: str | None = None
    """remote judge: the model name to ask for."""


def validate_judge(judge: JudgeConfig) -> None:
    """Raises ValueError, saying the fix, for a judge config that cannot score."""
    if judge.votes < 1:
        raise ValueError(f"judge.votes must be >= 1, got {judge.votes}")
    if judge.hint_selection not in HINT_SELECTIONS:
        raise ValueError(
            f"judge.hint_selection={judge.hint_selection!r}: choose one of {HINT_SELECTIONS}"
        )
    if judge.overlap_k < 1:
        raise ValueError(f"judge.overlap_k must be >= 1, got {judge.overlap_k}")
    if judge.kind == "remote" and not (judge.base_url and judge.model):
        raise ValueError(
            "judge=remote needs judge.base_url=http://HOST:PORT/v1 (and judge.model=NAME)"
        )
