"""The policy's side of an episode (`agents.rollout.Seat`): how `run_episode` reaches it.

- `ProxySeat`, the way training rolls out (docs/architecture.md, "Composition"): the policy
  is reached over HTTP through the token-exact proxy with the official `openai` client and
  the session headers, exactly as a live client reaches it; the proxy records every turn (it
  is the one writer of turns), and the seat tells it what only the environment knows (the
  episode's env, task and group; each turn's reward; the last observation and the outcome)
  through the proxy's episode routes (`agents.serving.episode_routes`).
- `DirectSeat`: the engine called in this process and the turns written to a store here;
  the leaderboard's scripted baselines play this way. With the same seed and sampling it
  stores the very token ids and log-probs the proxy stores (a test holds it to that).

A request the server refuses itself raises `EpisodeRefused` (with `context` when the prompt
is past the context); a server that fails otherwise raises what the client raised.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import openai

from agents.engines.base import Completion, ContextExceeded, SamplingParams
from agents.store import Store
from agents.trajectory import Session, SessionStatus, TurnType, sampled_turn

Message = Mapping[str, Any]

CONTEXT_CODE = "context_length_exceeded"
"""OpenAI's error code for a prompt past the context; the proxy answers it too."""


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
