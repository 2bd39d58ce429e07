"""The agent loop: a policy plays one episode of an environment, every turn stored.

`run_episode` plays an episode against a `Seat`, the policy's side of the table
(`agents.seats`: `ProxySeat`, through the token-exact proxy, the way training rolls out;
`DirectSeat`, an engine in this process). `Episode` records it as it is played, and
`Episode.ending` is the one place that decides how it ended.

A bad episode is data, never a dead run. A long agentic episode whose history outgrows the
policy's context gets context management: when the server refuses the prompt as past its
context (the proxy's error code `context_length_exceeded`, the engine's `ContextExceeded`),
its oldest observation still whole is replaced by `ELIDED` (`elide_oldest`) and the request
is sent again, until it fits. Later turns go on from the elided history, so what the policy
saw is what is stored, token-exactly: each turn's prompt is the history as sent (the proxy
links a turn's next state by its reply, which elision never touches, so a history that is
no longer a prefix of the last one still links). When nothing is left to elide, the episode
ends `truncated` with the reason "context". A request refused for another reason, or an
environment whose step raises (a sandbox that died), ends it `failed` with its reason. The
session keeps why it ended in its metadata (`end_reason`): "terminated", "max_turns" (the
environment's turn budget ran out), "context", or what failed. A server that fails (5xx,
gone) is no fault of the policy's: the episode ends `interrupted` (its turns are never
trained on), and the caller, which sees the status, decides whether to go on (the rollout
loop stops a run after `rollout.max_empty_episodes` such episodes in a row). A process that
is stopping (KeyboardInterrupt, SystemExit) ends the episode `interrupted` and stops.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import gymnasium as gym

from agents.engines.base import SamplingParams
from agents.seats import EpisodeRefused, Reply
from agents.trajectory import Session, SessionStatus

logger = logging.getLogger(__name__)

Message = Mapping[str, Any]

ELIDED = "[older output elided to fit the context]"
"""What an observation elided to fit the context says instead (`elide_oldest`)."""
TERMINATED, MAX_TURNS, CONTEXT = "terminated", "max_turns", "context"
"""Why an episode ended: the environment ended the task; its turn budget ran out (or it
aborted, with its reason: "aborted: ..."); the history did not fit the context, even elided."""


@dataclass(frozen=True)
class EpisodeSummary:
    """What one stored episode came to."""

    session_id: str
    task_id: str
    total_reward: float
    turns: int
    prompt_tokens: int
    completion_tokens: int
    terminated: bool
    """The environment ended the task (not its turn budget, nor the context)."""
    status: SessionStatus
    """`done` when the environment ended the episode (terminated, or its turn budget ran
    out), `truncated` when its history no longer fit the context, `failed` if it broke,
    `interrupted` if its server failed (no fault of the policy's)."""
    error: str | None = None
    """Why the episode ended early (`CONTEXT`, a refused request, a failed environment), or
    None when the environment ended it."""

    @classmethod
    def of(cls, session: Session) -> EpisodeSummary:
        """The summary of an episode stored in full (`Store.session`, its turns with it)."""
        reason = session.metadata.get("end_reason")
        return cls(
            session.session_id,
            session.task_id or "",
            session.outcome_reward or 0.0,
            len(session.turns),
            sum(len(t.prompt_token_ids) for t in session.turns),
            sum(len(t.completion_token_ids) for t in session.turns),
            reason == TERMINATED,
            status=session.status,
            error=None if session.status == SessionStatus.DONE else reason,
        )


@dataclass(frozen=True)
class Ending:
    """How an episode ended, as its session keeps it (`Seat.end`'s last two arguments)."""

    status: SessionStatus
    reason: str

    @property
    def error(self) -> str | None:
        """Why it ended early; None when the environment ended it."""
        return None if self.status == SessionStatus.DONE else self.reason


@dataclass
class Episode:
    """One episode as it is played: the history as sent, each turn's reward, the counts, and
    what stopped it before the environment ended it (`stopped_by`). `ending` decides how it
    ended, once it is over."""

    session_id: str
    task_id: str
    messages: list[dict[str, Any]]
    rewards: dict[int, float] = field(default_factory=dict)
    """Each turn's environment reward, by the turn's index in its session."""
    total: float = 0.0
    turns: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    """The last step's info."""
    stopped_by: Exception | None = None
    """The refused request (`EpisodeRefused`) or the environment's failure that ended it."""

    def record(
        self,
        reply: Reply,
        observation: Sequence[Message],
        reward: float,
        terminated: bool,
        truncated: bool,
        info: dict[str, Any],
    ) -> None:
        """A turn played: the reply, then what the environment answered."""
        self.rewards[reply.index if reply.index is not None else self.turns] = reward
        self.messages += [reply.message, *(dict(m) for m in observation)]
        self.total += reward
        self.prompt_tokens += reply.prompt_tokens
        self.completion_tokens += reply.completion_tokens
        self.turns += 1
        self.terminated, self.truncated, self.info = terminated, truncated, info

    def stop(self, cause: Exception) -> None:
        """Ends the episode before the environment does."""
        self.stopped_by = cause
        logger.warning("episode %s ends early: %s", self.session_id, _described(cause))

    def ending(self) -> Ending:
        """How the episode ended: the one place that decides it."""
        stop = self.stopped_by
        if isinstance(stop, EpisodeRefused):
            if stop.context:
                return Ending(SessionStatus.TRUNCATED, CONTEXT)
            return Ending(SessionStatus.FAILED, str(stop))
        if stop is not None:
            return Ending(SessionStatus.FAILED, f"the environment failed: {_described(stop)}")
        if self.info.get("failed") is not None:
            # the env broke (an exception it turned into the end of the episode)
            return Ending(SessionStatus.FAILED, f"the environment failed: {self.info['failed']}")
        if self.info.get("aborted") is not None:
            # the env cut the episode off (a browser that crashed): data, with its reason
            return Ending(SessionStatus.TRUNCATED, f"aborted: {self.info['aborted']}")
        return Ending(SessionStatus.DONE, TERMINATED if self.terminated else MAX_TURNS)

    def summary(self, ending: Ending) -> EpisodeSummary:
        """What the episode came to, once it ended so."""
        return EpisodeSummary(
            self.session_id,
            self.task_id,
            self.total,
            self.turns,
            self.prompt_tokens,
            self.completion_tokens,
            self.terminated,
            status=ending.status,
            error=ending.error,
        )


class Seat(Protocol):
    """The policy's side of an episode: opens its session, answers each turn, ends it."""

    def open(self, session: Session) -> None:
        """Opens the episode's session."""
        ...

    def reply(
        self,
        session_id: str,
        messages: Sequence[Message],
        tools: Sequence[Message],
        sampling: SamplingParams,
    ) -> Reply:
        """The policy's reply to the history, recorded as the session's next turn.

        Raises:
            EpisodeRefused: the server refused the request itself.
        """
        ...

    def end(
        self,
        session_id: str,
        messages: Sequence[Message],
        rewards: Mapping[int, float],
        outcome_reward: float,
        status: SessionStatus,
        reason: str | None = None,
    ) -> None:
        """Ends the session: the final history (the last turn's next state), each turn's
        environment reward, the outcome, and why it ended (`reason`, kept with it)."""
        ...


def run_episode(
    env: gym.Env[Any, Any],
    seat: Seat,
    *,
    env_id: str,
    task_id: str | None = None,
    seed: int | None = None,
    group_id: str | None = None,
    sampling: SamplingParams | None = None,
    session_id: str | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> EpisodeSummary:
    """Plays one episode with the seat's policy; the seat records it as a session (with
    `session_id`, given where the caller must be able to end it should this process die,
    else a new one, and `metadata`, kept with it). An env that cannot reset (a user model
    that is down) gives an episode of no turns and no session, with the reason as its
    `error`."""
    try:
        observation, info = env.reset(seed=seed, options={"task_id": task_id} if task_id else None)
    except Exception as failure:
        reason = f"the environment failed to reset: {_described(failure)}"
        logger.warning("episode of %s not played: %s", task_id, reason)
        return EpisodeSummary(
            "", task_id or "", 0.0, 0, 0, 0, False, status=SessionStatus.FAILED, error=reason
        )
    play = Episode(session_id or uuid.uuid4().hex, info["task_id"], [dict(m) for m in observation])
    seat.open(
        Session(
            play.session_id,
            env_id,
            task_id=play.task_id,
            group_id=group_id,
            metadata=dict(metadata or {}),
        )
    )
    try:
        _play(env, seat, play, info["tools"], sampling or SamplingParams())
    except Exception as broken:  # the server failed: the episode is over, the run is not
        ending = _end_interrupted(seat, play, broken)
        logger.warning("episode %s on %s: %s", play.session_id, play.task_id, ending.reason)
        return play.summary(ending)
    except BaseException as broken:  # the process is stopping
        _end_interrupted(seat, play, broken)
        raise
    ending = play.ending()
    seat.end(play.session_id, play.messages, play.rewards, play.total, ending.status, ending.reason)
    logger.info(
        "episode %s on %s: %s, reward %.2f in %d turns",
        play.session_id,
        play.task_id,
        ending.reason,
        play.total,
        play.turns,
    )
    return play.summary(ending)


def _play(
    env: gym.Env[Any, Any],
    seat: Seat,
    play: Episode,
    tools: Sequence[Message],
    sampling: SamplingParams,
) -> None:
    """Turns until the environment ends the episode, or a refused request or a failed
    step stops it (`Episode.stopped_by`)."""
    while not (play.terminated or play.truncated):
        try:
            reply, play.messages = _fitted_reply(
                seat, play.session_id, play.messages, tools, sampling
            )
        except EpisodeRefused as refused:
            play.stop(refused)
            return
        try:
            observation, reward, terminated, truncated, info = env.step(reply.message)
        except Exception as failure:  # a sandbox or browser that died: the episode ends
            play.messages.append(reply.message)
            play.stop(failure)
            return
        play.record(reply, observation, float(reward), terminated, truncated, info)


def _described(failure: BaseException) -> str:
    return f"{type(failure).__name__}: {failure}"


def _fitted_reply(
    seat: Seat,
    session_id: str,
    messages: list[dict[str, Any]],
    tools: Sequence[Message],
    sampling: SamplingParams,
) -> tuple[Reply, list[dict[str, Any]]]:
    """The seat's reply to the history, with the history as it was sent: while the server
    refuses the prompt as past its context, its oldest observation is elided and the
    request sent again.

    Raises:
        EpisodeRefused: a refusal for another reason, or past the context with nothing
            left to elide.
    """
    while True:
        try:
            return seat.reply(session_id, messages, tools, sampling), messages
        except EpisodeRefused as refused:
            elided = elide_oldest(messages) if refused.context else None
            if elided is None:
                raise
            logger.info("episode %s: an old observation elided to fit the context", session_id)
            messages = elided


def elide_oldest(messages: Sequence[Message], marker: str = ELIDED) -> list[dict[str, Any]] | None:
    """The history with the content of its oldest observation still whole replaced by
    `marker`; None when there is none left.

    An observation is what the environment said after the policy's first reply: a tool
    result or a user-role message. What comes before that reply (the system prompt, the
    task) and the last observation (after the last reply) are kept whole: without them the
    policy cannot know what it is doing, nor answer what it was just told. Replies are kept
    too (the proxy links each turn to what follows its reply). Only an observation longer
    than the marker is elided, so that each elision shortens the prompt.
    """
    replies = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not replies:
        return None
    for i in range(replies[0] + 1, replies[-1]):
        message = messages[i]
        if message.get("role") in ("tool", "user") and _length(message) > len(marker):
            elided = [dict(m) for m in messages]
            elided[i]["content"] = marker
            return elided
    return None


def _length(message: Message) -> int:
    """Characters of a message's content (a string, or a list of text parts)."""
    content = message.get("content")
    if isinstance(content, list):
        return sum(len(str(part.get("text", ""))) for part in content)
    return len(content) if isinstance(content, str) else 0


def _end_interrupted(seat: Seat, play: Episode, broken: BaseException) -> Ending:
    """Ends a session that broke off `interrupted`, where its server still answers (one
    that does not leaves it open: a resumed run ends it so, `trainers.pipeline`)."""
    ending = Ending(SessionStatus.INTERRUPTED, f"the episode broke off: {_described(broken)}")
    try:
        seat.end(
            play.session_id, play.messages, play.rewards, play.total, ending.status, ending.reason
        )
    except Exception as error:  # the original failure is what the caller must see
        logger.warning("could not end session %s: %s", play.session_id, error)
    return ending
