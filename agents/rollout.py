"""The agent loop: a policy plays one episode of an environment, every turn stored.

`run_episode` plays an episode against a `Seat`, the policy's side of the table:

- `ProxySeat`, the way training rolls out (DESIGN.md, "Composition"): the policy is
  reached over HTTP through the token-exact proxy with the official `openai` client and the
  session headers, exactly as a live client reaches it; the proxy records every turn (it is
  the one writer of turns), and the seat tells it what only the environment knows (the
  episode's env, task and group; each turn's reward; the last observation and the outcome)
  through the proxy's episode routes (`agents.episode_routes`).
- `DirectSeat`: the engine called in this process and the turns written to a store here;
  the leaderboard's scripted baselines play this way. With the same seed and sampling it
  stores the very token ids and log-probs the proxy stores (a test holds it to that).

A request the policy's server refuses (a prompt past the context) or an environment whose
step raises (a sandbox that died) ends the episode as failed, with its reason in the
summary: a bad episode is data. A server that fails (5xx, gone) raises: that is no
episode's fault, and the caller decides.
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

from agents.engines.base import Engine, SamplingParams
from agents.sessions import sampled_turn
from agents.store import Store
from agents.trajectory import Session, SessionStatus, TurnType

logger = logging.getLogger(__name__)

Message = Mapping[str, Any]


class EpisodeRefused(ValueError):
    """The policy's server refused a turn's request (e.g. a prompt past the context)."""


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
    error: str | None = None
    """Why the episode ended early (a refused request, a failed environment), or None."""


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
    ) -> None:
        """Ends the session: the final history (the last turn's next state), each turn's
        environment reward, the outcome."""
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
) -> EpisodeSummary:
    """Plays one episode with the seat's policy; the seat records it as a session. An env
    that cannot reset (a user model that is down) gives an episode of no turns and no
    session, with the reason as its `error`."""
    try:
        observation, info = env.reset(seed=seed, options={"task_id": task_id} if task_id else None)
    except Exception as failure:
        reason = f"the environment failed to reset: {type(failure).__name__}: {failure}"
        logger.warning("episode of %s not played: %s", task_id, reason)
        return EpisodeSummary("", task_id or "", 0.0, 0, 0, 0, False, reason)
    session_id = uuid.uuid4().hex
    seat.open(Session(session_id, env_id, task_id=info["task_id"], group_id=group_id))
    messages: list[dict[str, Any]] = [dict(m) for m in observation]
    rewards: dict[int, float] = {}
    total, turns, prompt_tokens, completion_tokens = 0.0, 0, 0, 0
    terminated = truncated = False
    error: str | None = None
    try:
        while not (terminated or truncated):
            try:
                reply = seat.reply(
                    session_id, messages, info["tools"], sampling or SamplingParams()
                )
            except EpisodeRefused as refused:
                error = str(refused)
                logger.warning("episode %s ends early: %s", session_id, error)
                break
            try:
                observation, reward, terminated, truncated, _ = env.step(reply.message)
            except Exception as failure:  # a sandbox or browser that died: the episode ends
                error = f"the environment failed: {type(failure).__name__}: {failure}"
                logger.warning("episode %s ends early: %s", session_id, error)
                messages.append(reply.message)
                break
            rewards[reply.index if reply.index is not None else turns] = float(reward)
            messages += [reply.message, *(dict(m) for m in observation)]
            total += float(reward)
            prompt_tokens += reply.prompt_tokens
            completion_tokens += reply.completion_tokens
            turns += 1
    except BaseException:
        _end_quietly(seat, session_id, messages, rewards, total)
        raise
    status = SessionStatus.FAILED if error else SessionStatus.DONE
    seat.end(session_id, messages, rewards, total, status)
    logger.info(
        "episode %s on %s: reward %.2f in %d turns", session_id, info["task_id"], total, turns
    )
    return EpisodeSummary(
        session_id,
        info["task_id"],
        total,
        turns,
        prompt_tokens,
        completion_tokens,
        terminated,
        error,
    )


def _end_quietly(
    seat: Seat,
    session_id: str,
    messages: Sequence[Message],
    rewards: Mapping[int, float],
    total: float,
) -> None:
    """Marks a session that broke off failed, where its server still answers."""
    try:
        seat.end(session_id, messages, rewards, total, SessionStatus.FAILED)
    except Exception as error:  # the original failure is what the caller must see
        logger.warning("could not end session %s: %s", session_id, error)


class DirectSeat:
    """The engine in this process; the turns written to `store` here."""

    def __init__(self, engine: Engine, store: Store):
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
            raise EpisodeRefused(str(error)) from error
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
    ) -> None:
        self._link(session_id, messages)
        self._last.pop(session_id, None)
        self.store.set_env_rewards(session_id, rewards)
        self.store.finish_session(session_id, outcome_reward, status)

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
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 1800.0):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No retries: a retried turn would be sampled (and recorded) twice.
        self.client = openai.OpenAI(
            base_url=self.base_url, api_key=api_key or "none", max_retries=0, timeout=timeout
        )
        root = self.base_url.removesuffix("/v1")
        self._admin = httpx.Client(base_url=root, headers=headers, timeout=60.0)

    def open(self, session: Session) -> None:
        body = {
            "session_id": session.session_id,
            "env_id": session.env_id,
            "task_id": session.task_id,
            "group_id": session.group_id,
        }
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
                extra_headers={"X-Session-Id": session_id, "X-Turn-Type": "main"},
                **extra,
            )
        except openai.BadRequestError as error:
            raise EpisodeRefused(_error_message(error)) from error
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
    ) -> None:
        body = {
            "messages": list(messages),
            "rewards": {str(i): r for i, r in rewards.items()},
            "outcome_reward": outcome_reward,
            "status": str(status),
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
