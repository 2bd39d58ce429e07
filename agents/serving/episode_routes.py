"""The proxy's episode routes: how a simulated episode's client tells the proxy what only
the environment knows, so that the proxy stays the one writer of turns and sessions.

- `POST /admin/sessions` `{"session_id", "env_id", "task_id"?, "group_id"?, "metadata"?}`
  opens the episode's session before its first request (a live client's session is opened
  by its first request instead, as env `live`); `metadata` (an object of strings, numbers
  and booleans, such as the rollout worker that plays it) is kept with the session.
- Each turn is an ordinary `POST /v1/chat/completions` with `X-Session-Id`; its response's
  `X-Turn-Index` header gives the turn's index in the session.
- `POST /admin/sessions/{id}/end` `{"messages", "rewards"?, "outcome_reward"?, "status"?,
  "reason"?}` ends it: `messages` is the final history (the environment's last observation
  after the last reply: that turn's next state), `rewards` maps turn indexes to the
  environment's reward of each, `status` is `done` (default), `truncated`, `failed` or
  `interrupted` (no fault of the policy's: its turns are never trained on), and
  `reason` says why it ended (kept in the session's metadata as `end_reason`).

Both are admin routes: they need the proxy's admin key and a JSON body (`agents.serving.proxy`).
`agents.seats.ProxySeat` is the client side.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import FastAPI, Request

from agents.serving import openai_api as api
from agents.serving.identity import SessionEnded, SessionRefused, checked_id
from agents.serving.proxy import Proxy
from agents.trajectory import Session, SessionStatus

ENDED = (
    SessionStatus.DONE,
    SessionStatus.TRUNCATED,
    SessionStatus.FAILED,
    SessionStatus.INTERRUPTED,
)
"""The statuses an episode's client may end its session with."""
MAX_REASON = 2000
"""Most characters of an end's reason that are kept."""
MAX_METADATA = 2000
"""Most characters of an opened session's metadata, as JSON."""
RESERVED = frozenset({"end_reason", "demonstration"})
"""Metadata keys the proxy and the trainer write themselves."""


def add_episode_routes(routes: FastAPI, proxy: Proxy) -> None:
    """Adds the episode routes to the proxy's app."""

    @routes.post("/admin/sessions")
    async def open_session(request: Request) -> dict[str, Any]:
        proxy.check_admin(request.headers)
        session = _session(api.json_object(await request.body()))
        await proxy.checkpoints.writable()
        try:
            proxy.sessions.open(session)
        except SessionRefused as error:
            raise api.ApiError(409, str(error), param=error.param) from error
        return {"session_id": session.session_id}

    @routes.post("/admin/sessions/{session_id}/end")
    async def end_session(request: Request, session_id: str) -> dict[str, Any]:
        proxy.check_admin(request.headers)
        body = api.json_object(await request.body())
        messages, rewards = _messages(body), _rewards(body)
        outcome, status, reason = _outcome(body), _status(body), _reason(body)
        await proxy.checkpoints.writable()
        try:
            proxy.sessions.end(checked(session_id), messages, rewards, outcome, status, reason)
        except KeyError as error:
            raise api.ApiError(404, f"no session {session_id!r}", param="session_id") from error
        except SessionEnded as error:
            raise api.ApiError(409, str(error), code="session_ended") from error
        return {"session_id": session_id, "status": str(status)}


def checked(session_id: Any) -> str:
    """A session id the proxy can take, or a 400."""
    try:
        return checked_id(session_id)
    except SessionRefused as error:
        raise api.ApiError(400, str(error), param="session_id") from error


def _optional_text(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise api.ApiError(400, f"{name} must be a string or null", param=name)
    return value


def _session(body: dict[str, Any]) -> Session:
    env_id = body.get("env_id")
    if not isinstance(env_id, str) or not env_id:
        raise api.ApiError(400, "env_id must be a non-empty string", param="env_id")
    return Session(
        checked(body.get("session_id")),
        env_id,
        task_id=_optional_text(body, "task_id"),
        group_id=_optional_text(body, "group_id"),
        metadata=_metadata(body),
    )


def _metadata(body: dict[str, Any]) -> dict[str, Any]:
    """An opened session's own metadata: flat, small, and none of the keys kept for the
    proxy's and the trainer's own records."""
    given = body.get("metadata") or {}
    if not isinstance(given, dict) or not all(
        isinstance(value, str | int | float | bool) for value in given.values()
    ):
        raise api.ApiError(
            400, "metadata must map names to strings, numbers or booleans", param="metadata"
        )
    if RESERVED & given.keys():
        raise api.ApiError(400, f"metadata may not set {sorted(RESERVED)}", param="metadata")
    if len(json.dumps(given)) > MAX_METADATA:
        raise api.ApiError(400, f"metadata is over {MAX_METADATA} characters", param="metadata")
    return given


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages", [])
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise api.ApiError(400, "messages must be a list of message objects", param="messages")
    return messages


def _rewards(body: dict[str, Any]) -> dict[int, float]:
    given = body.get("rewards") or {}
    if not isinstance(given, dict):
        raise api.ApiError(400, 'rewards must map turn indexes to numbers: {"0": 1.0}')
    rewards = {}
    for key, value in given.items():
        if not str(key).isdigit() or not _finite(value):
            raise api.ApiError(
                400, f"rewards: turn index {key!r} -> {value!r} is not index -> finite number"
            )
        rewards[int(key)] = float(value)
    return rewards


def _outcome(body: dict[str, Any]) -> float | None:
    value = body.get("outcome_reward")
    if value is not None and not _finite(value):
        raise api.ApiError(400, "outcome_reward must be a finite number or null")
    return None if value is None else float(value)


def _status(body: dict[str, Any]) -> SessionStatus:
    status = body.get("status", "done")
    if not isinstance(status, str) or status not in ENDED:
        raise api.ApiError(
            400,
            f"status must be one of {', '.join(map(str, ENDED))}, got {status!r}",
            param="status",
        )
    return SessionStatus(status)


def _reason(body: dict[str, Any]) -> str | None:
    """The end's reason, its first `MAX_REASON` characters (an environment's error may
    carry a whole log: the reason is for people, and the episode must still end)."""
    reason = _optional_text(body, "reason")
    return None if reason is None else reason[:MAX_REASON]


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
