"""Any registered `clawgym/` env served over OpenEnv's protocol, built on openenv-core's own
`HTTPEnvServer`: one env instance per WebSocket session (`/ws`), made when the session
opens and closed when it ends, so sessions never share an episode.

Run it with `python -m envs.openenv serve clawgym/Arith-v0 --port 8010`. The server runs in
OpenEnv's production mode: `/ws` plays episodes, `/health`, `/schema` and `/metadata`
describe it; OpenEnv's stateless HTTP `/reset` and `/step` (a fresh env per request) are
left out, as no clawgym episode fits in one request. It binds loopback unless told
otherwise, and any other address needs an API key, which every request must then carry as
`Authorization: Bearer <key>`. A malformed message gets an error message back and the
session goes on; an env that raises ends nothing but that step. `envs.openenv.limits` caps
the sessions (globally and per client), expires idle HTTP-made ones and closes idle and
slow connections.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import json
import logging
from typing import Any

import gymnasium as gym
import uvicorn
from fastapi import FastAPI
from openenv.core.env_server.http_server import HTTPEnvServer
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import ConcurrencyConfig, EnvironmentMetadata, ServerMode
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

import envs  # noqa: F401  (registers the clawgym ids)
from envs.openenv.limits import ServerLimits, SessionLimiter, uvicorn_options
from envs.openenv.protocol import API_KEY_HEADER, ChatAction, ChatObservation, ChatState

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


class GymEnvironment(Environment):
    """One Gymnasium env behind OpenEnv's `Environment` interface (one per session).

    Args:
        env_id: a registered id, e.g. "clawgym/Arith-v0".
        env_kwargs: passed to `gymnasium.make`.
    """

    SUPPORTS_CONCURRENT_SESSIONS = True  # each session builds its own instance

    def __init__(self, env_id: str, env_kwargs: dict[str, Any]):
        super().__init__()
        self.env_id = env_id
        self._env = gym.make(env_id, **env_kwargs)
        self._state = ChatState(step_count=0)
        self._closed = False

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> ChatObservation:
        messages, info = self._env.reset(seed=seed, options=options)
        self._state = ChatState(episode_id=episode_id, step_count=0, task_id=info.get("task_id"))
        return ChatObservation(messages=_jsonable(messages), info=_jsonable(info))

    def step(self, action: ChatAction, **kwargs: Any) -> ChatObservation:
        messages, reward, terminated, truncated, info = self._env.step(action.message)
        self._state.step_count += 1
        return ChatObservation(
            messages=_jsonable(messages),
            info=_jsonable(info),
            reward=float(reward),
            done=bool(terminated or truncated),
            terminated=bool(terminated),
            truncated=bool(truncated),
        )

    @property
    def state(self) -> ChatState:
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        doc = (type(self._env.unwrapped).__doc__ or "").strip()
        return EnvironmentMetadata(name=self.env_id, description=doc.splitlines()[0] if doc else "")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._env.close()


def _jsonable(value: Any) -> Any:
    """`value` as plain JSON types (info may hold numpy numbers or paths)."""
    return json.loads(json.dumps(value, default=str))


class RequireApiKey:
    """ASGI middleware: every HTTP request and WebSocket handshake must carry the key as
    `Authorization: Bearer <key>`; others get 401 (HTTP) or a refused handshake."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            sent = dict(scope["headers"]).get(API_KEY_HEADER.lower().encode(), b"")
            if not hmac.compare_digest(sent, self._expected):
                logger.warning("refused a request without the API key from %s", scope["client"])
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                else:
                    await JSONResponse({"detail": "missing or wrong API key"}, 401)(
                        scope, receive, send
                    )
                return
        await self.app(scope, receive, send)


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server to this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def build_app(
    env_id: str,
    env_kwargs: dict[str, Any] | None = None,
    *,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
) -> tuple[FastAPI, HTTPEnvServer]:
    """The server's app and OpenEnv's session manager behind it (for its session count).

    One env is made and closed first, so an unknown id or bad kwargs fail here, at start,
    rather than in every session.

    Raises:
        ValueError: unknown `env_id` or kwargs its env rejects.
    """
    env_kwargs, limits = dict(env_kwargs or {}), limits or ServerLimits()
    if env_id not in gym.registry:
        raise ValueError(f"unknown env id {env_id!r}; registered: {sorted(gym.registry)}")
    try:
        GymEnvironment(env_id, env_kwargs).close()
    except Exception as error:
        raise ValueError(f"{env_id} cannot be made with kwargs {env_kwargs}: {error}") from error
    sessions = HTTPEnvServer(
        functools.partial(GymEnvironment, env_id, env_kwargs),
        ChatAction,
        ChatObservation,
        concurrency_config=ConcurrencyConfig(max_concurrent_envs=limits.max_sessions),
    )
    app = FastAPI(title=f"clawgym {env_id} over OpenEnv")
    sessions.register_routes(app, mode=ServerMode.PRODUCTION)
    keyed = bool(api_key)
    app.add_middleware(SessionLimiter, sessions=sessions, limits=limits, keyed=keyed)
    if api_key:  # outermost: a request without the key reaches nothing
        app.add_middleware(RequireApiKey, api_key=api_key)
    return app, sessions


def serve(
    env_id: str,
    env_kwargs: dict[str, Any] | None = None,
    *,
    host: str = LOOPBACK,
    port: int = 8010,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
) -> None:
    """Serves `env_id` until interrupted, with `limits` (defaults: `ServerLimits`).

    Raises:
        ValueError: a non-loopback `host` without an `api_key`, or what `build_app` refuses.
    """
    if not api_key and not is_loopback(host):
        raise ValueError(
            f"binding {host} exposes the env beyond this machine: give an API key "
            "(--api-key or $CLAWGYM_OPENENV_API_KEY), or bind 127.0.0.1"
        )
    limits = limits or ServerLimits()
    app, _ = build_app(env_id, env_kwargs, api_key=api_key, limits=limits)
    logger.info("serving %s over OpenEnv at ws://%s:%d/ws", env_id, host, port)
    uvicorn.run(app, host=host, port=port, log_level="info", **uvicorn_options(limits))
