"""The questions of `clawgym/Chat-v0` and its tasks, with a fixed train / held-out split.

Questions come from `questions.json` (package data a user may replace): each family pairs
templates with subjects, and every template is asked about every subject of its family.
The split is by subject, from a hash of family and subject, so every question about a
held-out subject ("inflation", "boil an egg") is held out: the training split never sees
a rephrasing of a test question. A task is one persona and a few questions, drawn by a
generator seeded with the task id, so a task id always means the same conversation.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from dataclasses import dataclass
from importlib import resources

from envs.chat.personas import PERSONAS

SPLITS = ("train", "test")
TASKS_PER_PERSONA = {"train": 120, "test": 20}
TEST_SHARE = 5
"""One subject in TEST_SHARE is held out."""


@dataclass(frozen=True)
class Question:
    """One question a simulated user may ask."""

    text: str
    family: str
    subject: str


@dataclass(frozen=True)
class ChatTask:
    """One conversation: the persona who talks and the questions they ask, in order."""

    task_id: str
    persona: str
    questions: tuple[str, ...]


def split_of(family: str, subject: str) -> str:
    """The split a subject belongs to; stable whatever else the file holds."""
    digest = hashlib.sha256(f"{family}/{subject}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_SHARE == 0 else "train"


@functools.cache
def load_questions(split: str) -> tuple[Question, ...]:
    """Every question of a split, in file order."""
    _check_split(split)
    raw = json.loads(resources.files("envs.chat").joinpath("questions.json").read_text("utf-8"))
    questions = []
    for family, spec in raw["families"].items():
        for subject in spec["subjects"]:
            if split_of(family, subject) != split:
                continue
            for template in spec["templates"]:
                questions.append(Question(template.format(x=subject), family, subject))
    return tuple(questions)


@functools.cache
def load_tasks(split: str, questions_per_episode: int = 3) -> dict[str, ChatTask]:
    """Every task of a split, by id: TASKS_PER_PERSONA[split] for each persona."""
    pool = load_questions(split)
    if not 1 <= questions_per_episode <= len(pool):
        raise ValueError(
            f"questions_per_episode must be between 1 and {len(pool)}, got {questions_per_episode}"
        )
    tasks: dict[str, ChatTask] = {}
    for persona in PERSONAS:
        for index in range(TASKS_PER_PERSONA[split]):
            task_id = f"chat/{split}/{persona}/{index:04d}"
            rng = random.Random(f"{task_id}/{questions_per_episode}")
            picked = _distinct_subjects(rng, pool, questions_per_episode)
            tasks[task_id] = ChatTask(task_id, persona, tuple(q.text for q in picked))
    return tasks


def _distinct_subjects(rng: random.Random, pool: tuple[Question, ...], k: int) -> list[Question]:
    """k questions in random order, about different subjects while there are enough."""
    order = rng.sample(pool, len(pool))
    picked: list[Question] = []
    for question in order:
        if all(q.subject != question.subject for q in picked):
            picked.append(question)
        if len(picked) == k:
            return picked
    rest = [q for q in order if q not in picked]
    return picked + rest[: k - len(picked)]


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {list(SPLITS)}")
