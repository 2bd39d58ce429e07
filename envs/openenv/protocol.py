"""The messages clawgym's envs exchange over OpenEnv, and the client that sends them.

OpenEnv's WebSocket protocol (`/ws`): the client sends `{"type": "reset", "data": {...}}`,
`{"type": "step", "data": <action>}`, `{"type": "state"}` or `{"type": "close"}`; the server
answers `{"type": "observation", "data": {"observation", "reward", "done"}}`, `{"type":
"state", ...}` or `{"type": "error", "data": {"message", "code"}}`. clawgym's action is one
assistant message; its observation carries the new messages, Gymnasium's `info` and
`truncated` (OpenEnv's single `done` is `terminated or truncated`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

logger = logging.getLogger(__name__)

API_KEY_HEADER = "Authorization"


class ChatAction(Action):
    """One assistant message (OpenAI format) or a plain string as its content. Any JSON is
    accepted here: a malformed message is the env's to answer with an error observation."""

    message: Any = Field(description="the assistant message, or a string as its content")


class ChatObservation(Observation):
    """What one reset or step of a clawgym env returns besides reward and `done`."""

    messages: list[dict[str, Any]] = Field(default_factory=list, description="new messages")
    info: dict[str, Any] = Field(default_factory=dict, description="Gymnasium's info")
    terminated: bool = Field(default=False, description="the task ended")
    truncated: bool = Field(default=False, description="the turn budget ran out, or aborted")


class ChatState(State):
    """The session's episode: OpenEnv's id and step count, and the task being played."""

    task_id: str | None = Field(default=None, description="the current task's id")


class ChatEnvClient(EnvClient[ChatAction, ChatObservation, ChatState]):
    """OpenEnv's client for clawgym's messages, with an optional API key sent as a bearer
    token when the WebSocket opens.

    Args:
        base_url: the server, e.g. "http://127.0.0.1:8010".
        api_key: the server's key, or None for a loopback server without one.
        **kwargs: passed to `EnvClient` (timeouts, message size).
    """

    _ws: ClientConnection | None

    def __init__(self, base_url: str, api_key: str | None = None, **kwargs: Any):
        super().__init__(base_url, **kwargs)
        self._api_key = api_key

    async def connect(self) -> ChatEnvClient:
        if self._api_key is None:
            await super().connect()
            return self
        if self._ws is None:  # EnvClient.connect cannot send headers
            try:
                self._ws = await ws_connect(
                    self._ws_url,
                    open_timeout=self._connect_timeout,
                    max_size=self._max_message_size,
                    additional_headers={API_KEY_HEADER: f"Bearer {self._api_key}"},
                )
            except Exception as error:
                raise ConnectionError(f"cannot connect to {self._ws_url}: {error}") from error
        return self

    async def disconnect(self) -> None:
        """Ends the session and waits for the server to close the socket, which it does
        after closing the session's env (EnvClient's own disconnect closes first, and the
        server then fails closing a socket already closed)."""
        if self._ws is None:
            return
        ws, self._ws = self._ws, None
        try:
            await ws.send(json.dumps({"type": "close"}))
            await asyncio.wait_for(ws.wait_closed(), self._message_timeout)
        except Exception as error:  # the server is gone already: nothing left to end
            logger.debug("closing the session at %s: %s", self._ws_url, error)
        finally:
            await ws.close()

    def _step_payload(self, action: ChatAction) -> dict[str, Any]:
        return {"message": action.message}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[ChatObservation]:
        observation = ChatObservation(
            **payload.get("observation", {}),
            reward=payload.get("reward"),
            done=payload.get("done", False),
        )
        return StepResult(observation, payload.get("reward"), bool(payload.get("done", False)))

    def _parse_state(self, payload: dict[str, Any]) -> ChatState:
        return ChatState(**payload)
