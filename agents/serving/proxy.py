"""The token-exact OpenAI-compatible proxy's state (docs/architecture.md, "Proxy"): the
engine it serves, the store it commits every turn to, the sessions it records
(`agents.serving.sessions`), its keys and the policy version it serves. Every request runs
on the event loop (`Proxy` says why); its routes are `agents.serving.app`'s, one
chat-completions request is an `agents.serving.chat_turn.ChatTurn`. `python -m agents.serve`
runs it; the trainer serves it from a thread with `agents.serving.server.in_thread`.

Publishing an adapter (`Proxy.publish_adapter`, or `POST /admin/adapters`) never interrupts
serving: the engine swaps versions atomically and no request ever gets a 503 for it.

A bearer API key is checked when one is configured (`agents.serve` requires one beyond
loopback). The admin routes change what is served and what is trained on, so they need the
admin key as their bearer token on loopback too (`ProxyConfig.admin_key`, else one
generated at start, logged once, and in process `Proxy.admin_key`) and a JSON body
(`Content-Type: application/json`, which a page cannot send cross-site without the
server's consent, never given); `agents.serving.app` says what else keeps web pages out.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from agents.config import MAX_IMAGE_BYTES, MAX_IMAGES
from agents.engines.base import BASE, MAX_TOP_LOGPROBS, POLICY, Engine
from agents.engines.replicas import ReplicaSet, SessionEngine
from agents.serving import openai_api as api
from agents.serving.identity import (
    bearer,
    credential,
    home_credentials,
    is_one_of,
    user_credentials,
    user_of,
)
from agents.serving.sessions import SessionTracker
from agents.store import Store
from agents.trajectory import TurnType
from agents.vision import ImageLimits

logger = logging.getLogger(__name__)

LIVE_ENV_ID = "live"
"""The env id of the sessions clients open by their requests (a simulated episode's session
is opened with its own env's name)."""
CHECKPOINT_TURNS = 128
"""Turns the proxy commits between two WAL checkpoints (SQLite's own default is about
every 160 turns of a short conversation)."""


@dataclass(frozen=True)
class ProxyConfig:
    """How the proxy serves."""

    model_name: str = "policy"
    """Also accepted as a name of the policy (besides `policy`)."""
    api_key: str | None = None
    """The bearer token of the proxy's own clients (they keep their session ids as sent);
    None and no `user_keys`: no check."""
    user_keys: Mapping[str, str] = field(default_factory=dict)
    """Users' bearer tokens, each with the user it names (`agents.api_keys.read_keys`): a
    /v1 request must carry one of these or `api_key`; a user's sessions are its own."""
    admin_key: str | None = None
    """Bearer token every /admin request must carry, on loopback too; None: one is
    generated at start and logged (`Proxy.admin_key` in process)."""
    default_turn_type: TurnType = TurnType.MAIN
    """The turn type of requests that do not say."""
    max_tokens: int = 512
    """Completion budget of requests that do not set one."""
    env_id: str = LIVE_ENV_ID
    """`env_id` of the sessions the proxy records."""
    session_idle_s: float = 600.0
    """A session without a request for this long has its turns that nothing continued
    ended with an empty next state (so the judge can let them go) and leaves memory."""
    max_body_bytes: int = 32 << 20
    """Larger request bodies are refused (413) before they are parsed."""
    idle_timeout_s: float = 30.0
    """A connection without a request under way is closed after this long. Longer than
    httpx's 5 s keep-alive (the openai client's), so that a client closes its idle
    connections first: a request sent on one as the server closes it fails."""
    request_timeout_s: float = 60.0
    """A request's head and body must arrive within this long of its first byte, else the
    connection is closed (32 MB at 1 MB/s takes half of it)."""
    top_logprobs: int = 0
    """Top-k log-probs every sampled turn keeps at each position, whatever its client asks
    for (the top-k methods train on them; 0: none)."""
    max_image_bytes: int = MAX_IMAGE_BYTES
    """Largest image a request may carry (decoded); larger is a 400 (`invalid_image`). A
    run sets it from `model.max_image_bytes` (`agents.compose.proxy_config`)."""
    max_images: int = MAX_IMAGES
    """Most images one request's messages may carry; more is a 400 (`invalid_image`)."""

    def image_limits(self) -> ImageLimits:
        return ImageLimits(self.max_image_bytes, self.max_images)

    def __post_init__(self) -> None:
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs}"
            )
        limits = (self.session_idle_s, self.idle_timeout_s, self.request_timeout_s)
        if not all(limit > 0 for limit in limits) or self.max_body_bytes < 1:
            raise ValueError(
                f"session_idle_s, idle_timeout_s, request_timeout_s and max_body_bytes must "
                f"be positive, got {limits} and {self.max_body_bytes}"
            )


class Proxy:
    """The proxy's state: engine, store, sessions, keys (`agents.serving.app.build_app`
    makes its ASGI application).

    A request runs on the event loop from start to end: the engine's `agenerate` /
    `astream` wake the loop when tokens come (`agents.engines.aio`), and the session
    bookkeeping and the store commit run on the loop too. Each is a fraction of a
    millisecond; handing them to a worker thread cost two thread hand-offs a request,
    each of which can wait up to the GIL's switch interval for the engine's thread.
    """

    def __init__(self, engine: Engine, store: Store, config: ProxyConfig | None = None):
        self.engine, self.store = engine, store
        self.config = config or ProxyConfig()
        self.admin_key = self.config.admin_key or _generated_admin_key()
        """The bearer key of the /admin routes (for in-process clients: `ProxySeat`)."""
        self.users = user_credentials(self.config.user_keys)
        """Users' keys, looked up by a hash of the credential (`identity.user_of`)."""
        self.home = home_credentials(self.config.api_key, users=bool(self.users))
        """The canonical credentials of the proxy's own clients (`agents.serving.identity`)."""
        self._admin = frozenset({bearer(self.admin_key)})
        self.sessions = SessionTracker(store, self.config.env_id)
        self._publish = threading.Lock()
        self.checkpoints = Checkpoints(store)
        self._expiry: asyncio.Task[None] | None = None

    def engine_for(self, session_id: str) -> Engine | SessionEngine:
        """The engine that serves a session: its own replica where the policy is served by
        several (`agents.engines.replicas`), so that its prefix stays cached there."""
        if isinstance(self.engine, ReplicaSet):
            return self.engine.for_session(session_id)
        return self.engine

    def publish_adapter(self, path: str, version: int) -> None:
        """Serves the adapter at `path` as policy version `version` from the next request on."""
        with self._publish:
            if version <= self.engine.policy_version:
                raise ValueError(
                    f"version {version} is not newer than the served {self.engine.policy_version}"
                )
            self.engine.load_adapter(path, version)

    def check_key(self, headers: Mapping[str, str]) -> None:
        """Refuses a request without the configured bearer key (a plain check per route:
        Starlette's HTTP middleware costs about a millisecond a request); `headers` have
        lower-case names."""
        if not (self.config.api_key or self.users):
            return
        given = credential(headers)
        if not is_one_of(given, self.home) and user_of(given, self.users) is None:
            raise api.ApiError(401, "a valid API key is required", code="invalid_api_key")

    def check_admin(self, headers: Mapping[str, str]) -> None:
        """Refuses an admin write without the admin key (401) or with a body that is not
        declared JSON (415: a web page can send `text/plain` anywhere without asking)."""
        if not is_one_of(credential(headers), self._admin):
            raise api.ApiError(
                401,
                "the admin key is required (Authorization: Bearer KEY): set it with "
                "serve.admin_key or CLAWGYM_ADMIN_KEY, or read the one the proxy logged",
                code="invalid_admin_key",
            )
        media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise api.ApiError(
                415,
                f"an admin request's body must be Content-Type: application/json, got "
                f"{media_type or 'none'!r}",
                code="unsupported_media_type",
            )

    def expire_sessions(self) -> None:
        """Starts the loop task that ends idle sessions' open turns (again on a new loop)."""
        if self._expiry is None or self._expiry.done():
            self._expiry = asyncio.ensure_future(self._expire_idle_sessions())

    async def _expire_idle_sessions(self) -> None:
        idle = self.config.session_idle_s
        while True:
            await asyncio.sleep(max(1.0, min(30.0, idle / 4)))
            try:
                await self.checkpoints.writable()
                if ended := self.sessions.expire_idle(idle):
                    logger.info("ended %d turns of sessions idle for %.0f s", ended, idle)
            except Exception:
                logger.exception("ending idle sessions failed")

    def adapter(self, model: str) -> str | None:
        """The adapter a request's `model` names (`policy`, its alias, or `base`), else a 404."""
        if model in ("policy", self.config.model_name):
            return POLICY
        if model == "base":
            return BASE
        raise api.ApiError(
            404,
            f"the model {model!r} does not exist; this server serves 'policy' and 'base'",
            param="model",
            code="model_not_found",
        )


class Checkpoints:
    """WAL checkpoints of a store the event loop writes to.

    The loop's writes never checkpoint: SQLite's automatic checkpoint fsyncs inside the
    commit that fills the log (7-13 ms every ~160 turns here). Every `CHECKPOINT_TURNS`
    turns one runs on a worker thread instead, and the loop's writes wait for it, while
    the loop goes on serving. Were they to go on, they would outrun it: SQLite starts the
    log over only after a checkpoint that no write overtook, so under steady load the log
    grew without end (measured: 35 MB after 2000 back-to-back turns, and each write
    slower than the last). At one request at a time the checkpoint is over before the
    next write comes, so nothing waits.
    """

    def __init__(self, store: Store):
        self.store = store
        self._loop_thread: int | None = None
        self._turns = 0
        self._running: asyncio.Future[None] | None = None

    async def writable(self) -> None:
        """Call on the loop before each write to the store: switches the loop's automatic
        checkpoints off once, and waits for a checkpoint that is running."""
        thread = threading.get_ident()
        if self._loop_thread != thread:
            self.store.leave_checkpoints_to_others()
            self._loop_thread = thread
        if self._running is not None:
            await asyncio.wait([self._running])

    def wrote(self, turns: int) -> None:
        """Counts turns written from the loop; starts a checkpoint every `CHECKPOINT_TURNS`."""
        self._turns += turns
        if self._turns >= CHECKPOINT_TURNS and self._running is None:
            self._turns = 0
            self._running = asyncio.ensure_future(asyncio.to_thread(self.store.checkpoint))
            self._running.add_done_callback(self._done)

    def _done(self, done: asyncio.Future[None]) -> None:
        self._running = None
        if not done.cancelled() and (error := done.exception()) is not None:
            logger.warning("store checkpoint failed: %s", error)


def _generated_admin_key() -> str:
    """A fresh admin key, logged once so that the operator can use it (at WARNING: seen at
    every log level `agents.serve` offers but error)."""
    key = secrets.token_urlsafe(24)
    logger.warning(
        "no admin key configured (serve.admin_key, CLAWGYM_ADMIN_KEY): the /admin routes "
        "take this one: %s",
        key,
    )
    return key
