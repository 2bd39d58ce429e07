"""The judge: scores a turn by its next state, and writes OPD hints (docs/architecture.md,
"Learning methods").

- Votes: m samples of the score prompt at temperature 0.6; each answer is read from its
  last `\\boxed{}`; unparsable votes are ignored; the majority wins; a tie or no valid vote
  gives 0, and a 0-scored turn is masked out of the loss.
- Hints: m samples of the hint prompt; a hint is a candidate when the sample answers
  `\\boxed{1}`, the text between the markers is longer than `hint_min_chars` and no earlier
  candidate says the same (at most 3 a turn). `hint_selection` picks one: the longest, the
  shortest, or (several candidates, `overlap`) the one whose hinted teacher's top-k agrees
  most with the student's, which the learner scores (`trainers.hint_choice`).
- Teacher: the base model (adapter off) scores the student's own completion tokens with
  the hint appended to the last user message.

Judges: `self` (the policy's base model through the same engine), `remote` (any
OpenAI-compatible endpoint), `env` (the environment's outcome), `feedback` (a reader of
plain user feedback with a phrase lexicon, for machines that cannot run a judge model
strong enough to read it), or a custom class given as `module:Class`. The prompt
templates are files a user can replace.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import random
import re
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from agents.engines.base import BASE, POLICY, Engine, SamplingParams
from agents.trajectory import Judgement, Message, Session, Turn
from agents.vision import images_of
from trainers.distillation import accepted_hints, select_hint
from trainers.judge_config import JudgeConfig

HINT_HEADER = "\n\n[user's hint / instruction]\n"
_BOXED = re.compile(r"\\boxed\{\s*([^{}]*?)\s*\}")
_HINT = re.compile(r"\[HINT_START\](.*?)\[HINT_END\]", re.DOTALL)
_VOTES = {"1": 1, "+1": 1, "-1": -1, "0": 0}


# -- parsing: pure functions ---------------------------------------------------------------
def parse_vote(text: str) -> int | None:
    """The vote in the last `\\boxed{}` of a judge's answer: +1, -1, 0, or None."""
    found = _BOXED.findall(text)
    return _VOTES.get(found[-1]) if found else None


def majority(votes: Sequence[int | None]) -> float:
    """The most common valid vote; 0 on a tie or when no vote is valid."""
    counts = Counter(v for v in votes if v is not None).most_common()
    if not counts or (len(counts) > 1 and counts[0][1] == counts[1][1]):
        return 0.0
    return float(counts[0][0])


def parse_hint(text: str, min_chars: int = 10) -> str | None:
    """The hint of one judge answer, if it says yes (`\\boxed{1}`) and the hint is long enough."""
    hint = marked_hint(text)
    return hint if parse_vote(text) == 1 and len(hint) > min_chars else None


def marked_hint(text: str) -> str:
    """The text between the last pair of hint markers, whitespace collapsed ("" if none)."""
    found = _HINT.findall(text)
    return " ".join(found[-1].split()) if found else ""


def hinted_judgement(
    votes: tuple[int, ...],
    score: float,
    candidates: Sequence[str],
    selection: str,
    teacher: Engine,
    turn: Turn,
) -> Judgement:
    """A judgement with its hint candidates and, chosen now, its hint and the teacher's
    log-probs. With `overlap` and several candidates the choice waits for the learner,
    which has the full distributions it needs (`trainers.hint_choice`)."""
    if selection == "overlap" and len(candidates) > 1:
        return Judgement(votes, score, hint_candidates=tuple(candidates))
    chosen = select_hint(candidates, (), "longest" if selection == "overlap" else selection)
    hint = None if chosen is None else candidates[chosen]
    return Judgement(votes, score, hint, teacher_logprobs(teacher, turn, hint), tuple(candidates))


def awaits_next_state(turn: Turn, session: Session) -> bool:
    """Whether a turn's next state may still come: none yet, and its session goes on. An
    empty next state is final (the proxy's: nothing continued the turn)."""
    return turn.next_state is None and session.status == "open"


def render_next_state(next_state: Sequence[Message]) -> tuple[str, str]:
    """The role and text of a next state, for the judge's prompt."""
    roles = [str(m.get("role", "user")) for m in next_state] or ["user"]
    role = "tool" if "tool" in roles else roles[-1]
    text = "\n".join(_text(m.get("content")) for m in next_state)
    return ("environment (tool result)" if role == "tool" else role), text


def with_hint(messages: Sequence[Message], hint: str) -> list[dict[str, Any]]:
    """The teacher's context: the hint appended to the last user message."""
    copied = [dict(m) for m in messages]
    for message in reversed(copied):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list) and any(_is_image(p) for p in content):
                # the images stay where they were: the teacher sees what the student saw
                message["content"] = [*content, {"type": "text", "text": HINT_HEADER + hint}]
            else:
                message["content"] = _text(content) + HINT_HEADER + hint
            return copied
    return [*copied, {"role": "user", "content": HINT_HEADER.lstrip() + hint}]


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") != "text"


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _reply_text(completion: Message) -> str:
    calls = completion.get("tool_calls") or []
    rendered = [json.dumps(c.get("function", c)) for c in calls]
    return "\n".join([_text(completion.get("content")), *rendered]).strip()


def fill(template: str, fields: dict[str, str]) -> str:
    """Puts the fields into their `{name}` slots; other braces (`\\boxed{1}`) stay as they are."""
    slots = re.compile("|".join(re.escape("{" + name + "}") for name in fields))
    return slots.sub(lambda match: fields[match.group(0)[1:-1]], template)


def load_template(name_or_path: str) -> str:
    """A prompt template: a file path, or the name of one shipped in trainers/prompts/."""
    path = Path(name_or_path)
    if path.is_file():
        return path.read_text()
    return resources.files("trainers").joinpath("prompts", f"{name_or_path}.txt").read_text()


# -- judges --------------------------------------------------------------------------------
class Judge(Protocol):
    """Adds votes, a score, a hint and teacher log-probs to a turn."""

    def judge(self, turn: Turn, session: Session, want_hint: bool) -> Judgement | None:
        """The judgement, or None when the turn cannot be judged yet."""
        ...


class LLMJudge:
    """A language-model judge (`self` or `remote`) with the policy's base model as teacher.

    Args:
        config: the judge's config.
        voter: the engine the votes and hints are sampled from.
        teacher: the engine whose base model scores the hinted context (the policy's own).
        voter_adapter: the voter's model (BASE: the policy's base model, adapter off).
    """

    def __init__(
        self, config: JudgeConfig, voter: Engine, teacher: Engine, voter_adapter: str | None = BASE
    ):
        if config.decoding not in ("guided", "free"):
            raise ValueError(f"judge.decoding={config.decoding!r}: use guided or free")
        self.config, self.voter, self.teacher = config, voter, teacher
        self.voter_adapter = voter_adapter
        self.score_template = load_template(config.score_template)
        self.hint_template = load_template(config.hint_template)
        self.hint_text_template = load_template(config.hint_text_template)

    def judge(self, turn: Turn, session: Session, want_hint: bool) -> Judgement | None:
        if awaits_next_state(turn, session):
            return None
        if not turn.next_state:
            return Judgement()  # nothing followed the turn: masked
        role, next_text = render_next_state(turn.next_state)
        fields = {"reply": _reply_text(turn.completion), "next_role": role, "next_state": next_text}
        rng = random.Random(f"{turn.session_id}/{turn.index}")
        guided = self.config.decoding == "guided"
        score_prompt = fill(self.score_template, fields)
        votes = (
            self._guided_votes(score_prompt, (1, -1, 0), rng)
            if guided
            else self._free_votes(score_prompt)
        )
        candidates = self._hints(fields, rng) if want_hint else []
        valid = tuple(v for v in votes if v is not None)
        selection = self.config.hint_selection
        return hinted_judgement(valid, majority(votes), candidates, selection, self.teacher, turn)

    def _hints(self, fields: dict[str, str], rng: random.Random) -> list[str]:
        """The turn's hint candidates (`trainers.distillation.accepted_hints`)."""
        prompt = fill(self.hint_template, fields)
        least = self.config.hint_min_chars
        if self.config.decoding == "free":
            answers = self._sample(prompt)
            return accepted_hints([(parse_vote(a), marked_hint(a)) for a in answers], least)
        if majority(self._guided_votes(prompt, (1, -1), rng)) != 1:
            return []
        texts = self._sample(fill(self.hint_text_template, fields))
        return accepted_hints([(1, text) for text in texts], least)

    def _free_votes(self, prompt: str) -> list[int | None]:
        return [parse_vote(answer) for answer in self._sample(prompt)]

    def _guided_votes(
        self, prompt: str, options: Sequence[int], rng: random.Random
    ) -> list[int | None]:
        """m votes drawn from the judge's own probabilities of answering each option."""
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        prompt_ids = self.voter.encode(messages)
        closing = len(self.voter.encode([*messages, {"role": "assistant", "content": ""}])) - len(
            prompt_ids
        )
        scores = []
        for option in options:
            answer = {"role": "assistant", "content": f"\\boxed{{{option}}}"}
            full = self.voter.encode([*messages, answer])
            if full[: len(prompt_ids)] != prompt_ids:
                raise ValueError(
                    "the judge's chat template does not extend prompts; use judge.decoding=free"
                )
            # the option's tokens and the end-of-turn token after them
            answer_ids = full[len(prompt_ids) : len(full) - closing + 1]
            scores.append(sum(self.voter.score(prompt_ids, answer_ids, adapter=self.voter_adapter)))
        weights = _softmax([s / max(self.config.temperature, 1e-6) for s in scores])
        return rng.choices(list(options), weights=weights, k=self.config.votes)

    def _sample(self, prompt: str) -> list[str]:
        sampling = SamplingParams(
            temperature=self.config.temperature, max_tokens=self.config.max_tokens
        )
        messages = [{"role": "user", "content": prompt}]
        with ThreadPoolExecutor(self.config.votes) as pool:  # lets a batching engine batch them
            futures = [
                pool.submit(self.voter.generate, messages, None, sampling, self.voter_adapter)
                for _ in range(self.config.votes)
            ]
            return [_text(f.result().message.get("content")) for f in futures]


def _softmax(values: Sequence[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    return [e / sum(exps) for e in exps]


def teacher_logprobs(teacher: Engine, turn: Turn, hint: str | None) -> tuple[float, ...] | None:
    """The base model's log-probs of the student's own tokens in the hinted context."""
    if hint is None:
        return None
    messages = with_hint(turn.prompt_messages, hint)
    prompt = teacher.encode(messages, turn.tools or None)
    # a vision-language policy's teacher sees the screenshots its student saw
    images = images_of(messages, None)
    return tuple(teacher.score(prompt, turn.completion_token_ids, BASE, images))


# Everyday English for "that was not what I wanted" and "that was what I wanted". A
# complaint wins over thanks ("thanks, but too long"); a request with no thanks ("please
# put it in bullet points") is a complaint too: a satisfied user asks for no change.
_DISSATISFIED = re.compile(
    r"\b(too (long|short|wordy|verbose|formal|casual)|not (right|quite|what|how|an answer"
    r"|listening|as)|didn'?t (answer|ask|want)|wrong|shorter|longer|redo|try again|once more"
    r"|forget it|never ?mind|drop it|I asked|instead|no more than|under \d+|you forgot"
    r"|where'?s)\b",
    re.IGNORECASE,
)
_SATISFIED = re.compile(
    r"\b(thanks|thank you|perfect|great|exactly|helpful|that works|got it|nice|all set)\b",
    re.IGNORECASE,
)
_REQUEST = re.compile(
    r"\b(please|por favor|should|always|only|every|more|less|without)\b", re.IGNORECASE
)
# Sentences that only ask for a retry or vent: no instruction a teacher could follow.
_NOT_AN_INSTRUCTION = re.compile(
    r"^(still not right|try again|can you redo that|please redo it|once more, please"
    r"|forget it|never ?mind|hello)\b",
    re.IGNORECASE,
)


def feedback_vote(text: str) -> int:
    """+1 when a user's reply reads satisfied, -1 when it complains or asks for a change,
    0 when it says neither."""
    if _DISSATISFIED.search(text):
        return -1
    if _SATISFIED.search(text):
        return 1
    return -1 if _REQUEST.search(text) else 0


def feedback_hint(text: str) -> str:
    """The instructions of a complaint: its sentences less bare retries and venting."""
    sentences = re.split(r"(?<=[.!?])\s+", text.strip())
    kept = [s for s in sentences if s and not _NOT_AN_INSTRUCTION.match(s)]
    return " ".join(kept)


class FeedbackJudge:
    """Reads the user's reply with a phrase lexicon instead of a judge model: a complaint
    scores -1 and its instructions ("keep it under 25 words") become the OPD hint, thanks
    score +1, anything else 0 (masked). It never sees the environment's preference check,
    only the words a person wrote, so it stands in for a judge model that reads them well
    (what OpenClaw-RL gets from a large judge) on a CPU machine whose judge would be the
    135M policy itself. The teacher is still the policy's base model.

    Args:
        config: the judge's config (`hint_min_chars`).
        engine: serves the teacher (the policy's base model).
    """

    def __init__(self, config: JudgeConfig, engine: Engine):
        self.config, self.engine = config, engine

    def judge(self, turn: Turn, session: Session, want_hint: bool) -> Judgement | None:
        if awaits_next_state(turn, session):
            return None
        if not turn.next_state:
            return Judgement()  # nothing followed the turn: masked
        role, text = render_next_state(turn.next_state)
        if role != "user":
            return Judgement()  # a tool result is no person's feedback
        vote = feedback_vote(text)
        # a complaint is what carries the user's instruction: its hint stands as a yes
        hints = [(1, feedback_hint(text))] if want_hint and vote == -1 else []
        candidates = accepted_hints(hints, self.config.hint_min_chars)
        selection = self.config.hint_selection
        return hinted_judgement((vote,), float(vote), candidates, selection, self.engine, turn)


class EnvJudge:
    """Scores every turn of a finished episode with the sign of its outcome reward: the
    environment's verifiable verdict (tests pass, task solved). No votes, no hints."""

    def judge(self, turn: Turn, session: Session, want_hint: bool) -> Judgement | None:
        if session.status == "open":
            return None
        outcome = session.outcome_reward or 0.0
        return Judgement(votes=(), score=float((outcome > 0) - (outcome < 0)))


def build_judge(config: JudgeConfig, engine: Engine) -> Judge:
    """The judge a config names; `engine` serves the policy (and its base model)."""
    if config.kind == "self":
        return LLMJudge(config, voter=engine, teacher=engine)
    if config.kind == "env":
        return EnvJudge()
    if config.kind == "feedback":
        return FeedbackJudge(config, engine)
    if config.kind == "remote":
        from agents.compose import build_engine
        from agents.config import EngineConfig, ModelConfig

        if not (config.base_url and config.model):
            raise ValueError(
                "judge=remote needs judge.base_url=http://HOST:PORT/v1 and judge.model=NAME"
            )
        upstream = EngineConfig(backend="remote", base_url=config.base_url, api_key=config.api_key)
        remote = build_engine(upstream, ModelConfig(name=config.model))
        free = dataclasses.replace(config, decoding="free")  # a remote server scores no ids
        return LLMJudge(free, voter=remote, teacher=engine, voter_adapter=POLICY)
    module, _, name = config.kind.partition(":")
    if not name:
        raise ValueError(
            f"judge.kind={config.kind!r}: use self, remote, env, feedback, or module:Class"
        )
    judge: Judge = getattr(importlib.import_module(module), name)(config, engine)
    return judge
