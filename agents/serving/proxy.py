"""The token-exact OpenAI-compatible proxy (DESIGN.md, "Proxy"): an ASGI app in front of
any engine (chat completions served directly, the other routes by FastAPI); every request
runs on the event loop (`Proxy` says why). `python -m agents.serve` runs it; the trainer
serves it from a thread with `agents.serving.server.in_thread`.

Routes: `POST /v1/chat/completions` (plain, or real token-by-token server-sent events),
`GET /v1/models` (`policy`, and `base`: the adapter switched off), `GET /healthz`, and
`POST /admin/adapters` (`{"path", "version"}`) to publish a new policy version (in process,
`Proxy.publish_adapter` does the same), and the episode routes of `agents.serving.episode_routes`
(`POST /admin/sessions`, `POST /admin/sessions/{id}/end`), through which a simulated
episode's client tells the proxy its env, task, group, rewards and last observation, so that
training's own rollouts are recorded by the proxy like any client's turns. Publishing never
interrupts serving: the engine swaps versions atomically and no request ever gets a 503 for
it.

Every main turn is committed to the store, token-exactly with its policy version, before
its response completes (for a stream, before the chunk carrying `finish_reason`, so before
`[DONE]`); `agents.serving.sessions` says how sessions, side turns and next states work.

Bad input is a 4xx with OpenAI's error body (`agents.serving.chat_request` validates requests,
`agents.serving.openai_api` builds errors and responses). A bearer API key is checked when one is
configured (`agents.serve` requires one beyond loopback).

The admin routes change what is served and what is trained on, so they need more than
loopback: any web page open on this machine can reach loopback (a `text/plain` POST is sent
cross-site without asking). An admin request needs the admin key as its bearer token
(`ProxyConfig.admin_key`, else one generated at start, logged once, and in process
`Proxy.admin_key`) and a JSON body (`Content-Type: application/json`, which a page cannot
send cross-site without the server's consent, never given: no route sends CORS headers);
and any request from a web page (an `Origin` header, or `Sec-Fetch-Site` other than
`none`) is refused with a 403, so a page can neither call the proxy nor, through DNS
rebinding, read from it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from agents.engines.base import (
    BASE,
    POLICY,
    Completion,
    ContextExceeded,
    Engine,
    SamplingParams,
    TokenChunk,
)
from agents.engines.replicas import ReplicaSet, SessionEngine
from agents.serving import openai_api as api
from agents.serving.chat_request import ChatRequest, validation_message
from agents.serving.episode_routes import add_episode_routes
from agents.serving.http_protocol import CONNECTION_LOST
from agents.serving.sessions import (
    SessionEnded,
    SessionInfo,
    SessionNotOwned,
    SessionRefused,
    SessionTracker,
    identify,
)
from agents.store import Store
from agents.trajectory import TurnType

logger = logging.getLogger(__name__)

T = TypeVar("T")
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
    """Bearer token every /v1 request must carry; None: no check."""
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

    def __post_init__(self) -> None:
        limits = (self.session_idle_s, self.idle_timeout_s, self.request_timeout_s)
        if not all(limit > 0 for limit in limits) or self.max_body_bytes < 1:
            raise ValueError(
                f"session_idle_s, idle_timeout_s, request_timeout_s and max_body_bytes must "
                f"be positive, got {limits} and {self.max_body_bytes}"
            )


class Proxy:
    """The proxy's state: engine, store, sessions; `app` is the ASGI application.

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
        self.sessions = SessionTracker(store, self.config.env_id)
        self._publish = threading.Lock()
        self._checkpoints = _Checkpoints(store)
        self._expiry: asyncio.Task[None] | None = None
        self.app = _build_app(self)

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
        key = self.config.api_key
        if key and not _bearer_is(headers, key):
            raise api.ApiError(401, "a valid API key is required", code="invalid_api_key")

    def check_admin(self, headers: Mapping[str, str]) -> None:
        """Refuses an admin write without the admin key (401) or with a body that is not
        declared JSON (415: a web page can send `text/plain` anywhere without asking)."""
        if not _bearer_is(headers, self.admin_key):
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

    # -- chat completions ----------------------------------------------------------------
    async def chat(
        self, headers: Mapping[str, str], raw: bytes, scope: Scope, receive: Receive
    ) -> ASGIApp:
        """The response to a chat-completions request (`headers` with lower-case names);
        `scope` and `receive` tell when the client leaves."""
        chat = _chat_request(raw)
        try:  # the body's session fields are extra fields of the request: identify pops them
            info = identify(headers, chat.model_extra or {}, self.config.default_turn_type)
        except SessionRefused as error:
            raise api.ApiError(400, str(error), param=error.param) from error
        adapter = self._adapter(chat.model)
        if adapter is BASE:
            info = replace(info, turn_type=TurnType.SIDE)  # the base model is never trained
        self._expire_sessions()
        turn = _Turn(self, chat, info, adapter)
        if chat.stream:
            firsts = await turn.start_streams()
            return StreamingResponse(
                turn.events(firsts),
                media_type="text/event-stream",
                headers={"X-Session-Id": turn.info.session_id},
            )
        payload = await turn.complete(scope, receive)
        return _Json(payload, session_id=turn.info.session_id, turn_index=turn.first_index)

    def _expire_sessions(self) -> None:
        """Starts the loop task that ends idle sessions' open turns (again on a new loop)."""
        if self._expiry is None or self._expiry.done():
            self._expiry = asyncio.ensure_future(self._expire_idle_sessions())

    async def _expire_idle_sessions(self) -> None:
        idle = self.config.session_idle_s
        while True:
            await asyncio.sleep(max(1.0, min(30.0, idle / 4)))
            try:
                await self._checkpoints.writable()
                if ended := self.sessions.expire_idle(idle):
                    logger.info("ended %d turns of sessions idle for %.0f s", ended, idle)
            except Exception:
                logger.exception("ending idle sessions failed")

    def _adapter(self, model: str) -> str | None:
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


class _Checkpoints:
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


class _Turn:
    """One chat-completions request from validation to its committed turns."""

    def __init__(self, proxy: Proxy, chat: ChatRequest, info: SessionInfo, adapter: str | None):
        self.proxy, self.chat, self.info, self.adapter = proxy, chat, info, adapter
        self.messages = [m.for_engine() for m in chat.messages]
        self.tools = chat.tool_schemas()
        self.id = f"chatcmpl-{secrets.token_hex(16)}"
        self.created = int(time.time())
        self.sampling = [self._sampling(i) for i in range(chat.n)]
        self.first_index: int | None = None
        """The session index of the request's first turn, once committed."""

    def _sampling(self, choice: int) -> SamplingParams:
        chat = self.chat
        try:
            return SamplingParams(
                temperature=1.0 if chat.temperature is None else chat.temperature,
                top_p=1.0 if chat.top_p is None else chat.top_p,
                max_tokens=chat.max_completion_tokens
                or chat.max_tokens
                or self.proxy.config.max_tokens,
                stop=chat.stops(),
                seed=None if chat.seed is None else chat.seed + choice,
            )
        except ValueError as error:
            raise api.ApiError(400, str(error)) from error

    async def _begin(self) -> None:
        """Registers the request with its session (and links the session's previous turn)."""
        await self.proxy._checkpoints.writable()
        try:
            self.info = self.proxy.sessions.begin(self.info, self.messages)
        except SessionEnded as error:
            raise api.ApiError(
                409, str(error), param="X-Session-Id", code="session_ended"
            ) from error
        except SessionNotOwned as error:
            raise api.ApiError(
                403, str(error), param="X-Session-Done", code="session_not_owned"
            ) from error

    async def complete(self, scope: Scope, receive: Receive) -> dict[str, Any]:
        """The whole non-streaming request; a client that leaves cancels it."""
        await self._begin()
        engine = self.proxy.engine_for(self.info.session_id)
        calls = [
            engine.agenerate(self.messages, self.tools, s, self.adapter) for s in self.sampling
        ]
        try:
            completions = await _all(calls, scope, receive)
        except ClientDisconnect:
            raise
        except Exception as error:
            raise _engine_error(error) from error
        replies = await self._commit(completions)
        return api.response(self.chat, self.id, self.created, replies, completions)

    async def _commit(self, completions: list[Completion]) -> list[dict[str, Any]]:
        replies = [
            api.choice_message(c, f"call_{self.id[9:21]}_{i}") for i, c in enumerate(completions)
        ]
        await self.proxy._checkpoints.writable()
        self.first_index = self.proxy.sessions.commit(
            self.info, self.messages, completions, replies, self.tools or ()
        )
        self.proxy._checkpoints.wrote(len(completions))
        return replies

    # -- streaming -----------------------------------------------------------------------
    async def start_streams(
        self,
    ) -> list[tuple[AsyncGenerator[TokenChunk | Completion, None], Any]]:
        """Starts every choice and waits for its first item, so that an engine that fails
        lazily still fails before the response starts."""
        await self._begin()
        engine, streams = self.proxy.engine_for(self.info.session_id), []
        try:
            for sampling in self.sampling:
                streams.append(engine.astream(self.messages, self.tools, sampling, self.adapter))
            return [(stream, await anext(stream)) for stream in streams]
        except Exception as error:
            for stream in streams:
                await stream.aclose()
            raise _engine_error(error) from error

    async def events(
        self, firsts: list[tuple[AsyncGenerator[TokenChunk | Completion, None], Any]]
    ) -> AsyncIterator[str]:
        merged = _merged(firsts)
        try:
            async for line in self._sse(merged, len(firsts)):
                yield line
        finally:  # a client that went away cancels its engine requests
            await merged.aclose()
            for stream, _ in firsts:
                await stream.aclose()

    async def _sse(self, items: AsyncIterator[tuple[int, Any]], count: int) -> AsyncIterator[str]:
        chat, ids, logprobs = self.chat, self.chat.return_token_ids, self.chat.logprobs
        filters = [api.ContentStream(chat.stops()) for _ in range(count)]
        finals: dict[int, Completion] = {}
        for index in range(count):
            yield self._event([api.stream_delta(index, {"role": "assistant", "content": ""})])
        try:
            async for index, item in items:
                if isinstance(item, Completion):
                    finals[index] = item
                    continue
                delta = filters[index].feed(item.text)
                if delta or ids or logprobs:  # every sampled token's ids and log-probs are sent
                    extra: dict[str, Any] = {"token_ids": list(item.token_ids)} if ids else {}
                    if logprobs:
                        extra["logprobs"] = api.token_logprobs(item.token_ids, item.logprobs)
                    yield self._event([api.stream_delta(index, {"content": delta}, None, **extra)])
            completions = [finals[i] for i in range(count)]
            replies = await self._commit(completions)
        except Exception as error:  # the engine, or the store: the response never completes
            logger.error("stream %s failed: %s", self.id, error)
            yield _sse(api.error_body(f"the request failed: {error}", "server_error"))
            return
        for index, (reply, final) in enumerate(zip(replies, completions, strict=True)):
            async for line in self._closing(index, reply, final, filters[index]):
                yield line
        if chat.stream_options and chat.stream_options.include_usage:
            yield self._event([], usage=api.usage(completions))
        yield "data: [DONE]\n\n"

    async def _closing(
        self, index: int, reply: dict[str, Any], final: Completion, content: api.ContentStream
    ) -> AsyncIterator[str]:
        rest = content.finish(reply.get("content"))
        if rest:
            yield self._event([api.stream_delta(index, {"content": rest})])
        if reply.get("tool_calls"):
            calls = api.tool_call_deltas(reply)
            yield self._event([api.stream_delta(index, {"tool_calls": calls})])
        # With return_token_ids the prompt's ids come with the choice's last chunk: the
        # engine's stream only has them complete at its end.
        extra = (
            {"prompt_token_ids": list(final.prompt_token_ids)} if self.chat.return_token_ids else {}
        )
        yield self._event([api.stream_delta(index, {}, final.finish_reason)], **extra)

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        return _sse(api.chunk(self.chat, self.id, self.created, choices, **extra))


async def _all(calls: list[Coroutine[Any, Any, T]], scope: Scope, receive: Receive) -> list[T]:
    """Awaits every call; the first failure cancels the others and is raised, so does a
    client that leaves meanwhile (as `ClientDisconnect`): nothing is sampled for nobody.

    The server's connection-lost future (`agents.serving.http_protocol`) says the client left;
    under another ASGI server a task waits on `receive()` for it.
    """
    tasks = [asyncio.ensure_future(call) for call in calls]
    lost = scope.get("extensions", {}).get(CONNECTION_LOST)
    left = lost if lost is not None else asyncio.ensure_future(_disconnected(receive))

    def cancel(_: object) -> None:
        for task in tasks:
            task.cancel()

    left.add_done_callback(cancel)
    try:
        return [await task for task in tasks]
    except BaseException as error:
        cancel(None)
        if isinstance(error, asyncio.CancelledError) and left.done() and not left.cancelled():
            raise ClientDisconnect() from None
        raise
    finally:
        left.remove_done_callback(cancel)
        if left is not lost:
            left.cancel()


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has left (the body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _merged(
    firsts: Sequence[tuple[AsyncIterator[T], T]],
) -> AsyncGenerator[tuple[int, T], None]:
    """The items of several streams (each with its first item already taken) as they come,
    with the index of their stream; the first failure is raised."""
    if len(firsts) == 1:
        stream, first = firsts[0]
        yield 0, first
        async for item in stream:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
            queue.put_nowait((index, done))
        except Exception as error:
            queue.put_nowait((index, error))

    for index, (_, first) in enumerate(firsts):
        queue.put_nowait((index, first))
    tasks = [asyncio.ensure_future(pump(i, stream)) for i, (stream, _) in enumerate(firsts)]
    try:
        remaining = len(firsts)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # none still inside a stream


def _engine_error(error: Exception) -> api.ApiError:
    """What a client is told when the engine refuses or fails a request: a 400 for what the
    request asked (a prompt over the context, with OpenAI's code `context_length_exceeded`,
    which an episode's client acts on; a budget an upstream refuses), a 502 for an engine
    that broke; never a 500."""
    message = str(error)
    status = getattr(error, "status", None)
    if isinstance(error, ValueError) or (isinstance(status, int) and 400 <= status < 500):
        code = "context_length_exceeded" if isinstance(error, ContextExceeded) else None
        return api.ApiError(400, message, param="messages", code=code)
    logger.error("the engine failed: %s", message)
    return api.ApiError(502, f"the engine failed: {message}", "server_error")


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _chat_request(raw: bytes) -> ChatRequest:
    """The body parsed and validated in one pass by pydantic's JSON parser (about 50 us
    less than `json.loads` and validating the dict, measured after a forward pass)."""
    try:
        return ChatRequest.model_validate_json(raw)
    except ValidationError as error:
        first = error.errors()[0]
        if first["type"] == "json_invalid":
            raise api.ApiError(400, f"the body is not valid JSON: {first['msg']}") from error
        if first["type"] == "model_type" and not first["loc"]:
            raise api.ApiError(400, "the body must be a JSON object") from error
        message, param = validation_message(error.errors())
        raise api.ApiError(400, message, param=param) from error


def _build_app(proxy: Proxy) -> ASGIApp:
    routes = FastAPI(title="clawgym proxy", docs_url=None, redoc_url=None, openapi_url=None)
    routes.state.proxy = proxy
    _add_error_handlers(routes)

    @routes.api_route("/healthz", methods=["GET", "HEAD"])
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "policy_version": proxy.engine.policy_version}

    @routes.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        proxy.check_key(request.headers)
        names = dict.fromkeys(("policy", proxy.config.model_name, "base"))  # the alias too
        return {"object": "list", "data": [_model_card(name) for name in names]}

    @routes.get("/v1/models/{name:path}")
    async def model(request: Request, name: str) -> dict[str, Any]:
        proxy.check_key(request.headers)
        proxy._adapter(name)  # a 404 for a model this server does not serve
        return _model_card(name)

    @routes.post("/admin/adapters")
    async def publish(request: Request) -> dict[str, Any]:
        proxy.check_admin(request.headers)
        body = api.json_object(await request.body())
        path, version = body.get("path"), body.get("version")
        if not isinstance(path, str) or not isinstance(version, int) or isinstance(version, bool):
            raise api.ApiError(400, 'the body must be {"path": str, "version": int}')
        if not 0 < version < 2**63:  # the store keeps versions as SQLite integers
            raise api.ApiError(400, f"version must be in 1..2**63-1, got {version}")
        try:
            await asyncio.to_thread(proxy.publish_adapter, path, version)
        except Exception as error:  # a refused load leaves the previous version serving
            raise api.ApiError(409 if "newer" in str(error) else 400, str(error)) from error
        return {"policy_version": proxy.engine.policy_version}

    add_episode_routes(routes, proxy)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _from_a_page(scope["headers"]):
            refused = api.error_body("requests from web pages are refused", code="cross_origin")
            await _Json(refused, status=403)(scope, receive, send)
        elif scope["type"] == "http" and scope["path"] == "/v1/chat/completions":
            await _chat_completions(proxy, scope, receive, send)
        else:
            await routes(scope, receive, send)

    return app


async def _chat_completions(proxy: Proxy, scope: Scope, receive: Receive, send: Send) -> None:
    """The hot route, in plain ASGI: FastAPI's middleware stack and routing, Starlette's
    `Request` and `JSONResponse` cost about 0.2 ms a request together here (measured
    after the engine's forward pass, when caches are cold), a tenth of the proxy's whole
    overhead. Errors are answered as the app's handlers answer them."""
    response: ASGIApp
    try:
        if scope["method"] != "POST":
            raise api.ApiError(405, "Method Not Allowed")
        headers = {
            name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]
        }
        proxy.check_key(headers)
        body = await _body(receive, proxy.config.max_body_bytes)
        response = await proxy.chat(headers, body, scope, receive)
    except api.ApiError as error:
        response = _Json(error.body(), status=error.status)
    except ClientDisconnect:
        return
    except Exception as error:
        logger.exception("request failed")
        response = _Json(api.error_body(str(error), "server_error"), status=500)
    await response(scope, receive, send)


async def _body(receive: Receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            raise api.ApiError(413, f"the body is over {limit} bytes", code="request_too_large")
        if not message.get("more_body", False):
            return b"".join(chunks)


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


def _bearer_is(headers: Mapping[str, str], key: str) -> bool:
    """Whether the request's `Authorization` is `Bearer <key>` (compared in constant time)."""
    scheme, _, given = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(given.strip(), key)


def _from_a_page(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    """Whether a web page sent the request: browsers add `Origin` to every cross-site
    request that may change something (and to same-origin POSTs, DNS rebinding's), and
    `Sec-Fetch-Site` to every request (`none` when a person typed the address). The openai
    client, OpenClaw (Node's fetch) and curl send neither."""
    for name, value in headers:
        if name == b"origin" or (name == b"sec-fetch-site" and value != b"none"):
            return True
    return False


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "clawgym"}


class _Json:
    """A JSON response as two ASGI messages, with the session's headers when there are:
    `X-Session-Id`, and `X-Turn-Index` (the index of the request's first turn, which an
    episode's client reports rewards by)."""

    def __init__(
        self,
        payload: dict[str, Any],
        status: int = 200,
        session_id: str | None = None,
        turn_index: int | None = None,
    ):
        self.payload, self.status, self.session_id = payload, status, session_id
        self.turn_index = turn_index

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = json.dumps(self.payload, ensure_ascii=False, separators=(",", ":")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        if self.session_id is not None:
            headers.append((b"x-session-id", self.session_id.encode("latin-1")))
        if self.turn_index is not None:
            headers.append((b"x-turn-index", b"%d" % self.turn_index))
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(api.ApiError)
    async def refused(request: Request, error: api.ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(api.error_body(str(error.detail)), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def crashed(request: Request, error: Exception) -> JSONResponse:
        logger.exception("request failed")
        return JSONResponse(api.error_body(str(error), "server_error"), status_code=500)
