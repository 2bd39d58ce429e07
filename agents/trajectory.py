"""Trajectory records: the `Turn` the trainer learns from and the `Session` it belongs to.

A session is one episode or one live conversation; each assistant reply is a turn, and
whatever follows it (a user's reply, a tool result, a test verdict) is its next state.
Token ids and log-probs are the sampling engine's own; nothing here is re-tokenized.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agents.engines.base import Completion

Message = Mapping[str, Any]


class TurnType(enum.StrEnum):
    """`main` turns are trained; `side` turns (memory flushes, heartbeats) are only served."""

    MAIN = "main"
    SIDE = "side"


class TurnStatus(enum.StrEnum):
    """Where a turn is in the pipeline: collected -> judged -> trained, or dropped (judged
    but carrying no signal, or too stale to train on)."""

    COLLECTED = "collected"
    JUDGED = "judged"
    TRAINED = "trained"
    DROPPED = "dropped"


class SessionStatus(enum.StrEnum):
    """`open` while turns may still arrive; `done` once closed; `truncated` if an episode
    was cut short before its environment ended it (its history outgrew the policy's
    context); `failed` if it broke (a refused request, an environment that died): its turns
    are data like any other, the policy's doing. `interrupted` if it was cut off through no
    fault of the policy (its server failed, its rollout worker died, the run stopped): kept
    for the record, its turns are never trained on (the store drops them as it ends), since
    an outcome the policy did not cause is no signal about it. Every status but `open` is
    final. Why an episode ended is in the session's metadata, `end_reason`."""

    OPEN = "open"
    DONE = "done"
    TRUNCATED = "truncated"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


BROKE_OFF = (SessionStatus.FAILED, SessionStatus.INTERRUPTED)
"""The statuses of an episode that broke off before its environment ended it (its env
instance may be broken too; an evaluation counts it unsolved and `failed`)."""


@dataclass(frozen=True)
class Judgement:
    """What the judge adds to a turn."""

    votes: tuple[int, ...] = ()
    """Each valid vote: +1, -1 or 0."""
    score: float = 0.0
    """The majority, or 0 on a tie / no valid vote (the turn is then masked)."""
    hint: str | None = None
    """The accepted OPD hint, if any."""
    teacher_logprobs: tuple[float, ...] | None = None
    """Log-probs of the completion tokens under the hint-augmented teacher context."""
    hint_candidates: tuple[str, ...] = ()
    """Every hint the judge accepted for the turn, in sampling order; `hint` is one of them
    once chosen (`judge.hint_selection`)."""
    hint_overlaps: tuple[int, ...] = ()
    """Each candidate's overlap with the student (`trainers.hint_choice`), when several
    were chosen among by overlap; () otherwise."""

    def __post_init__(self) -> None:
        if self.hint_overlaps and len(self.hint_overlaps) != len(self.hint_candidates):
            raise ValueError(
                f"{len(self.hint_overlaps)} overlap scores for "
                f"{len(self.hint_candidates)} hint candidates"
            )

    @property
    def awaits_hint_choice(self) -> bool:
        """Several candidates and none chosen yet: the learner chooses by overlap."""
        return self.hint is None and len(self.hint_candidates) > 1


@dataclass(frozen=True)
class Turn:
    """One assistant reply, token-exact, with its next state and judgement."""

    session_id: str
    index: int
    """Position among the session's turns, from 0."""
    turn_type: TurnType
    prompt_messages: tuple[Message, ...]
    prompt_token_ids: tuple[int, ...]
    completion_token_ids: tuple[int, ...]
    completion_logprobs: tuple[float, ...]
    """Log-prob of each completion token under the policy that sampled it."""
    completion: Message
    """The assistant message: role, content and tool_calls."""
    policy_version: int
    """The adapter version that sampled this turn (0 is the base model)."""
    tools: tuple[Mapping[str, Any], ...] = ()
    """The OpenAI tool schemas the prompt was rendered with (the judge's teacher re-renders
    the prompt with a hint, and must render the same tools)."""
    completion_top_ids: tuple[tuple[int, ...], ...] = ()
    """The k likeliest token ids at each completion position under the policy that sampled
    it, likeliest first (the top-k methods' S_t); () when the engine was asked for none."""
    completion_top_logprobs: tuple[tuple[float, ...], ...] = ()
    """Their log-probs (raw, full-vocabulary, like `completion_logprobs`)."""
    next_state: tuple[Message, ...] | None = None
    """The messages that followed this reply; None until they arrive."""
    env_reward: float | None = None
    judgement: Judgement | None = None
    status: TurnStatus = TurnStatus.COLLECTED
    created_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if len(self.completion_logprobs) != len(self.completion_token_ids):
            raise ValueError(
                f"turn {self.session_id}/{self.index}: {len(self.completion_logprobs)} log-probs "
                f"for {len(self.completion_token_ids)} completion tokens; the engine must "
                "return one log-prob per sampled token"
            )
        if not _top_k_fits(
            self.completion_top_ids, self.completion_top_logprobs, len(self.completion_token_ids)
        ):
            raise ValueError(
                f"turn {self.session_id}/{self.index}: top-k ids and log-probs must hold k of "
                f"each for every one of its {len(self.completion_token_ids)} completion tokens"
            )
        if self.index < 0:
            raise ValueError(f"turn index must be >= 0, got {self.index}")

    def replace(self, **changes: Any) -> Turn:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def _top_k_fits(ids: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]], n: int) -> bool:
    """Whether top-k ids and log-probs are absent, or k of each (k > 0) for each of n tokens."""
    if not ids and not logprobs:
        return True
    widths = {len(top) for top in (*ids, *logprobs)}
    return len(ids) == len(logprobs) == n and len(widths) == 1 and 0 not in widths


@dataclass(frozen=True)
class Session:
    """An episode or a live conversation: its turns share a session id.

    Rollouts of the same task in the same batch share `group_id`: the GRPO baseline is
    taken over a group.
    """

    session_id: str
    env_id: str
    task_id: str | None = None
    group_id: str | None = None
    turns: tuple[Turn, ...] = ()
    outcome_reward: float | None = None
    status: SessionStatus = SessionStatus.OPEN
    created_at: float = field(default_factory=time.time)
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def replace(self, **changes: Any) -> Session:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def sampled_turn(
    session_id: str,
    index: int,
    turn_type: TurnType,
    messages: Sequence[Mapping[str, Any]],
    completion: Completion,
    reply: Mapping[str, Any],
    tools: Sequence[Mapping[str, Any]],
) -> Turn:
    """The turn an engine's completion makes, token-exact, with the reply as the client saw
    it (tool-call ids included). A server that names no token ids (an OpenAI endpoint the
    leaderboard plays) may still give log-probs: with no tokens to pin them to they would
    train nothing, so the turn keeps neither."""
    exact = bool(completion.completion_token_ids)
    return Turn(
        session_id=session_id,
        index=index,
        turn_type=turn_type,
        prompt_messages=tuple(messages),
        prompt_token_ids=completion.prompt_token_ids,
        completion_token_ids=completion.completion_token_ids,
        completion_logprobs=completion.completion_logprobs if exact else (),
        completion_top_ids=completion.top_ids if exact else (),
        completion_top_logprobs=completion.top_logprobs if exact else (),
        completion=reply,
        policy_version=completion.policy_version,
        tools=tuple(tools),
    )
