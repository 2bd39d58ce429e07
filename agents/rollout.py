"""The agent loop: a policy plays one episode of an environment, every turn stored.

`run_episode` plays an episode against a `Seat`, the policy's side of the table:

- `ProxySeat`, the way training rolls out (DESIGN.md, "Composition"): the policy is
  reached over HTTP through the token-exact proxy with the official `openai` client and the
  session headers, exactly as a live client reaches it; the proxy records every turn (it is
  the one writer of turns), and the seat tells it what only the environment knows (the
  episode's env, task and group; each turn's reward; the last observation and the outcome)
  through the proxy's episode routes (`agents.serving.episode_routes`).
- `DirectSeat`: the engine called in this process and the turns written to a store here;
  the leaderboard's scripted baselines play this way. With the same seed and sampling it
  stores the very token ids and log-probs the proxy stores (a test holds it to that).

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
gone) raises: that is no episode's fault, and the caller decides.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import gymnasium as gym
import httpx
import openai

from agents.engines.base import Completion, ContextExceeded, SamplingParams
from agents.serving.sessions import sampled_turn
from agents.store import Store
from agents.trajectory import Session, SessionStatus, TurnType

logger = logging.getLogger(__name__)

Message = Mapping[str, Any]

ELIDED = "[older output elided to fit the context]"
"""What an observation elided to fit the context says instead (`elide_oldest`)."""
CONTEXT_CODE = "context_length_exceeded"
"""OpenAI's error code for a prompt past the context; the proxy answers it too."""
TERMINATED, MAX_TURNS, CONTEXT = "terminated", "max_turns", "context"
"""Why an episode ended: the environment ended the task; its turn budget ran out (or it
aborted, with its reason: "aborted: ..."); the history did not fit the context, even elided."""


class EpisodeRefused(ValueError):
    """The policy's server refused a turn's request; `context`: because the prompt is past
    the context (a history the episode can shorten and send again)."""

    def __init__(self, message: str, context: bool = False):
        super().__init__(message)
        self.context = context


@dataclass(frozen=True)
class Reply:
    """One turn's reply as the seat got it."""

    message: dict[str, Any]
    """The assistant message (role, content, tool_calls), as the env's action."""
    index: int | None
    """The turn's index in its session (None where the server does not say)."""
    prompt_tokens: int
    completion_tokens: int


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
    out), `truncated` when its history no longer fit the context, `failed` if it broke."""
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
        reason = f"the environment failed to reset: {type(failure).__name__}: {failure}"
        logger.warning("episode of %s not played: %s", task_id, reason)
        return EpisodeSummary(
            "", task_id or "", 0.0, 0, 0, 0, False, status=SessionStatus.FAILED, error=reason
        )
    session_id = session_id or uuid.uuid4().hex
    seat.open(
        Session(
            session_id,
            env_id,
            task_id=info["task_id"],
            group_id=group_id,
            metadata=dict(metadata or {}),
        )
    )
    messages: list[dict[str, Any]] = [dict(m) for m in observation]
    rewards: dict[int, float] = {}
    total, turns, prompt_tokens, completion_tokens = 0.0, 0, 0, 0
    terminated = truncated = False
    step_info: dict[str, Any] = {}
    early: tuple[SessionStatus, str] | None = None  # an end before the environment's
    try:
        while not (terminated or truncated):
            try:
                reply, messages = _fitted_reply(
                    seat, session_id, messages, info["tools"], sampling or SamplingParams()
                )
            except EpisodeRefused as refused:
                if refused.context:
                    early = SessionStatus.TRUNCATED, CONTEXT
                else:
                    early = SessionStatus.FAILED, str(refused)
                logger.warning("episode %s ends early: %s", session_id, refused)
                break
            try:
                observation, reward, terminated, truncated, step_info = env.step(reply.message)
            except Exception as failure:  # a sandbox or browser that died: the episode ends
                reason = f"the environment failed: {type(failure).__name__}: {failure}"
                early = SessionStatus.FAILED, reason
                logger.warning("episode %s ends early: %s", session_id, reason)
                messages.append(reply.message)
                break
            rewards[reply.index if reply.index is not None else turns] = float(reward)
            messages += [reply.message, *(dict(m) for m in observation)]
            total += float(reward)
            prompt_tokens += reply.prompt_tokens
            completion_tokens += reply.completion_tokens
            turns += 1
    except BaseException as broken:
        _end_quietly(seat, session_id, messages, rewards, total, broken)
        raise
    if early is None and step_info.get("failed") is not None:
        # the env broke (an exception it turned into the end of the episode)
        early = SessionStatus.FAILED, f"the environment failed: {step_info['failed']}"
    elif early is None and step_info.get("aborted") is not None:
        # the env cut the episode off (a browser that crashed): data, with its reason
        early = SessionStatus.TRUNCATED, f"aborted: {step_info['aborted']}"
    status, reason = early or (SessionStatus.DONE, _env_end(terminated))
    seat.end(session_id, messages, rewards, total, status, reason)
    logger.info(
        "episode %s on %s: %s, reward %.2f in %d turns",
        session_id,
        info["task_id"],
        reason,
        total,
        turns,
    )
    return EpisodeSummary(
        session_id,
        info["task_id"],
        total,
        turns,
        prompt_tokens,
        completion_tokens,
        terminated,
        status=status,
        error=None if early is None else reason,
    )


def _env_end(terminated: bool) -> str:
    """Why the environment ended an episode it played to its end."""
    return TERMINATED if terminated else MAX_TURNS


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


def _end_quietly(
    seat: Seat,
    session_id: str,
    messages: Sequence[Message],
    rewards: Mapping[int, float],
    total: float,
    broken: BaseException,
) -> None:
    """Marks a session that broke off failed, where its server still answers."""
    reason = f"the episode broke off: {type(broken).__name__}: {broken}"
    try:
        seat.end(session_id, messages, rewards, total, SessionStatus.FAILED, reason)
    except Exception as error:  # the original failure is what the caller must see
        logger.warning("could not end session %s: %s", session_id, error)


class Generates(Protocol):
    """What `DirectSeat` asks of an engine: `Engine.generate`."""

    def generate(
        self,
        messages: Sequence[Message],
        tools: Sequence[Message] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = ...,
    ) -> Completion: ...


class DirectSeat:
    """The engine in this process (or anything that generates like one: the reference
    agents of `agents.demonstrations`); the turns written to `store` here."""

    def __init__(self, engine: Generates, store: Store):
        self.engine, self.store = engine, store
        self._last: dict[str, tuple[int, int]] = {}
        """Session id -> its last turn's index and prompt length."""

    def open(self, session: Session) -> None:
        self.store.add_session(session)

    def reply(
        self,
        session_id: str,
        messages: Sequence[Message],
        tools: Sequence[Message],
        sampling: SamplingParams,
    ) -> Reply:
        try:
            completion = self.engine.generate(messages, tools, sampling)
        except ValueError as error:  # the engine refused the request (e.g. the context)
            raise EpisodeRefused(str(error), isinstance(error, ContextExceeded)) from error
        index = self._link(session_id, messages) + 1
        self.store.add_turn(
            sampled_turn(
                session_id, index, TurnType.MAIN, messages, completion, completion.message, tools
            )
        )
        self._last[session_id] = (index, len(messages))
        return Reply(
            dict(completion.message),
            index,
            len(completion.prompt_token_ids),
            len(completion.completion_token_ids),
        )

    def end(
        self,
        session_id: str,
        messages: Sequence[Message],
        rewards: Mapping[int, float],
        outcome_reward: float,
        status: SessionStatus,
        reason: str | None = None,
    ) -> None:
        self._link(session_id, messages)
        self._last.pop(session_id, None)
        self.store.set_env_rewards(session_id, rewards)
        self.store.finish_session(session_id, outcome_reward, status, reason)

    def _link(self, session_id: str, messages: Sequence[Message]) -> int:
        """Gives the session's last turn what the history adds after its reply as its next
        state; returns that turn's index (-1 before the first)."""
        index, prompt_length = self._last.get(session_id, (-1, 0))
        if index >= 0:
            self.store.set_next_state(session_id, index, list(messages[prompt_length + 1 :]))
        return index


class ProxySeat:
    """The policy behind the proxy at `base_url` (`.../v1`), reached with the official
    `openai` client; the proxy records the turns.

    Args:
        base_url: the proxy's OpenAI-compatible base URL.
        api_key: the proxy's bearer key, if it has one.
        timeout: seconds one request may take (a long agentic turn on a CPU takes minutes).
        turn_type: the turns' type: main turns train; side turns (held-out evaluation) are
            stored but never judged or trained.
        admin_key: the proxy's admin key, which its episode routes take (`Proxy.admin_key`
            in process).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float = 1800.0,
        turn_type: TurnType = TurnType.MAIN,
        *,
        admin_key: str,
    ):
        self.base_url = base_url.rstrip("/")
        self.turn_type = turn_type
        # No retries: a retried turn would be sampled (and recorded) twice.
        self.client = openai.OpenAI(
            base_url=self.base_url, api_key=api_key or "none", max_retries=0, timeout=timeout
        )
        root = self.base_url.removesuffix("/v1")
        admin = {"Authorization": f"Bearer {admin_key}"}
        self._admin = httpx.Client(base_url=root, headers=admin, timeout=60.0)

    def open(self, session: Session) -> None:
        body: dict[str, Any] = {
            "session_id": session.session_id,
            "env_id": session.env_id,
            "task_id": session.task_id,
            "group_id": session.group_id,
        }
        if session.metadata:
            body["metadata"] = dict(session.metadata)
        _checked(self._admin.post("/admin/sessions", json=body))

    def reply(
        self,
        session_id: str,
        messages: Sequence[Message],
        tools: Sequence[Message],
        sampling: SamplingParams,
    ) -> Reply:
        extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
        if sampling.seed is not None:
            extra["seed"] = sampling.seed
        if sampling.stop:
            extra["stop"] = list(sampling.stop)
        try:
            raw = self.client.chat.completions.with_raw_response.create(
                model="policy",
                messages=list(messages),  # type: ignore[arg-type]
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                extra_headers={"X-Session-Id": session_id, "X-Turn-Type": str(self.turn_type)},
                **extra,
            )
        except openai.BadRequestError as error:
            raise EpisodeRefused(_error_message(error), error.code == CONTEXT_CODE) from error
        response = raw.parse()
        message = response.choices[0].message.model_dump(exclude_none=True)
        message.setdefault("content", None)
        index = raw.headers.get("x-turn-index")
        usage = response.usage
        return Reply(
            {k: v for k, v in message.items() if k in ("role", "content", "tool_calls")},
            int(index) if index is not None else None,
            usage.prompt_tokens if usage else 0,
            usage.completion_tokens if usage else 0,
        )

    def end(
        self,
        session_id: str,
        messages: Sequence[Message],
        rewards: Mapping[int, float],
        outcome_reward: float,
        status: SessionStatus,
        reason: str | None = None,
    ) -> None:
        body = {
            "messages": list(messages),
            "rewards": {str(i): r for i, r in rewards.items()},
            "outcome_reward": outcome_reward,
            "status": str(status),
            "reason": reason,
        }
        _checked(self._admin.post(f"/admin/sessions/{session_id}/end", json=body))

    def close(self) -> None:
        self.client.close()
        self._admin.close()


def _checked(response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise RuntimeError(
            f"the proxy refused {response.request.method} {response.request.url.path} "
            f"({response.status_code}): {response.text[:500]}"
        )


def _error_message(error: openai.APIStatusError) -> str:
    body = error.body if isinstance(error.body, dict) else {}
    return str(body.get("message") or error.message)
