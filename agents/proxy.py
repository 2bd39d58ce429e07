"""The token-exact OpenAI-compatible proxy (DESIGN.md, "Proxy"): a FastAPI app in front
of any engine. `python -m agents.serve` runs it; the trainer builds it with `create_app`.

Routes: `POST /v1/chat/completions` (plain, or real token-by-token server-sent events),
`GET /v1/models` (`policy`, and `base`: the adapter switched off), `GET /healthz`, and
`POST /admin/adapters` (`{"path", "version"}`) to publish a new policy version; in
process, `Proxy.publish_adapter` does the same. Publishing never interrupts serving: the
engine swaps versions atomically and no request ever gets a 503 for it.

Every main turn is committed to the store, token-exactly with its policy version, before
its response completes (for a stream, before the chunk carrying `finish_reason`, so before
`[DONE]`); `agents.sessions` says how sessions, side turns and next states work.

Bad input is a 4xx with OpenAI's error body (`agents.openai_api`). A bearer API key is
checked when one is configured (`agents.serve` requires one beyond loopback).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from agents import openai_api as api
from agents.engines.base import BASE, POLICY, Completion, Engine, SamplingParams, TokenChunk
from agents.sessions import SessionInfo, SessionTracker, identify
from agents.store import Store
from agents.trajectory import TurnType

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProxyConfig:
    """How the proxy serves."""

    model_name: str = "policy"
    """Also accepted as a name of the policy (besides `policy`)."""
    api_key: str | None = None
    """Bearer token every /v1 and /admin request must carry; None: no check."""
    default_turn_type: TurnType = TurnType.MAIN
    """The turn type of requests that do not say."""
    max_tokens: int = 512
    """Completion budget of requests that do not set one."""
    env_id: str = "live"
    """`env_id` of the sessions the proxy records."""
    workers: int = 256
    """Threads that wait on the engine and the store (bounds requests in flight)."""
    start_on_loop: bool = False
    """Start requests on the engine from the event loop: only for an engine whose `stream`
    just queues the request and returns (the embedded engine; `agents.serve` sets it).
    The thread that then waits for it wakes while the engine computes instead of before,
    one thread hop less on every request's critical path."""


class Proxy:
    """The proxy's state: engine, store, sessions; `app` is the ASGI application."""

    def __init__(self, engine: Engine, store: Store, config: ProxyConfig | None = None):
        self.engine, self.store = engine, store
        self.config = config or ProxyConfig()
        self.sessions = SessionTracker(store, self.config.env_id)
        self._pool = ThreadPoolExecutor(self.config.workers, thread_name_prefix="proxy")
        self._publish = threading.Lock()
        self.app = _build_app(self)

    def publish_adapter(self, path: str, version: int) -> None:
        """Serves the adapter at `path` as policy version `version` from the next request on."""
        with self._publish:
            if version <= self.engine.policy_version:
                raise ValueError(
                    f"version {version} is not newer than the served {self.engine.policy_version}"
                )
            self.engine.load_adapter(path, version)

    def check_key(self, request: Request) -> None:
        """Refuses a request without the configured bearer key (a plain check per route:
        Starlette's HTTP middleware costs about a millisecond a request)."""
        key = self.config.api_key
        if key and request.headers.get("authorization", "") != f"Bearer {key}":
            raise api.ApiError(401, "a valid API key is required", code="invalid_api_key")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, function: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, function, *args)

    # -- chat completions ----------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        body = _json_object(await request.body())
        try:
            info = identify(request.headers, body, self.config.default_turn_type)
        except ValueError as error:
            raise api.ApiError(400, str(error), param="X-Turn-Type") from error
        try:
            chat = api.ChatRequest.model_validate(body)
        except ValidationError as error:
            message, param = api.validation_message(error.errors())
            raise api.ApiError(400, message, param=param) from error
        adapter = self._adapter(chat.model)
        if adapter is BASE:
            info = replace(info, turn_type=TurnType.SIDE)  # the base model is never trained
        turn = _Turn(self, chat, info, adapter)
        if self.config.start_on_loop:
            turn.submit()
        headers = {"X-Session-Id": info.session_id}
        if chat.stream:
            first = await self.run(turn.start_streams)
            return StreamingResponse(
                turn.events(first), media_type="text/event-stream", headers=headers
            )
        return JSONResponse(await self.run(turn.complete), headers=headers)

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


class _Turn:
    """One chat-completions request from validation to its committed turns."""

    def __init__(self, proxy: Proxy, chat: api.ChatRequest, info: SessionInfo, adapter: str | None):
        self.proxy, self.chat, self.info, self.adapter = proxy, chat, info, adapter
        self.messages = [m.for_engine() for m in chat.messages]
        self.tools = chat.tool_schemas()
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sampling = [self._sampling(i) for i in range(chat.n)]
        self.first = 0
        self.streams: list[Iterator[TokenChunk | Completion]] | None = None

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

    def submit(self) -> None:
        """Starts every choice on the engine (the engine batches them), once."""
        if self.streams is not None:
            return
        try:
            self.streams = [
                self.proxy.engine.stream(self.messages, self.tools, s, self.adapter)
                for s in self.sampling
            ]
        except Exception as error:
            raise _engine_error(error) from error

    def _streams(self) -> list[Iterator[TokenChunk | Completion]]:
        """The started choices, their turn indexes reserved (on a worker thread: the
        store may be written)."""
        self.submit()
        assert self.streams is not None
        self.first = self.proxy.sessions.begin(self.info, self.messages, len(self.streams))
        return self.streams

    def complete(self) -> dict[str, Any]:
        """Runs on a worker thread: the whole non-streaming request."""
        streams = self._streams()
        try:
            completions = [_last(s) for s in streams]
        except Exception as error:
            raise _engine_error(error) from error
        replies = self._commit(completions)
        return api.response(self.chat, self.id, self.created, replies, completions)

    def _commit(self, completions: list[Completion]) -> list[dict[str, Any]]:
        replies = [
            api.choice_message(c, f"call_{self.id[9:21]}_{i}") for i, c in enumerate(completions)
        ]
        self.proxy.sessions.commit(
            self.info, self.first, self.messages, completions, replies, self.tools or ()
        )
        return replies

    # -- streaming -----------------------------------------------------------------------
    def start_streams(self) -> list[tuple[Iterator[TokenChunk | Completion], Any]]:
        """Runs on a worker thread: starts the streams and waits for each first item, so
        that an engine that fails lazily still fails before the response starts."""
        streams = self._streams()
        firsts = []
        for stream in streams:
            try:
                firsts.append((stream, next(stream)))
            except Exception as error:
                raise _engine_error(error) from error
        return firsts

    async def events(self, firsts: list[tuple[Iterator[Any], Any]]) -> AsyncIterator[str]:
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        stop = threading.Event()
        loop = asyncio.get_running_loop()
        for index, (stream, first) in enumerate(firsts):
            loop.run_in_executor(self.proxy._pool, _pump, stream, first, index, queue, loop, stop)
        try:
            async for line in self._sse(queue, len(firsts)):
                yield line
        finally:
            stop.set()  # a client that went away cancels its engine requests

    async def _sse(self, queue: asyncio.Queue[tuple[int, Any]], count: int) -> AsyncIterator[str]:
        chat, ids = self.chat, self.chat.return_token_ids
        filters = [api.ContentStream(chat.stops()) for _ in range(count)]
        finals: dict[int, Completion] = {}
        for index in range(count):
            yield self._event([api.stream_delta(index, {"role": "assistant", "content": ""})])
        while len(finals) < count:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                logger.error("stream %s failed: %s", self.id, item)
                yield _sse(api.error_body(f"the engine failed: {item}", "server_error"))
                return
            if isinstance(item, Completion):
                finals[index] = item
                continue
            delta = filters[index].feed(item.text)
            if delta or ids:
                extra: dict[str, Any] = {"token_ids": list(item.token_ids)} if ids else {}
                yield self._event([api.stream_delta(index, {"content": delta}, None, **extra)])
        completions = [finals[i] for i in range(count)]
        replies = await self.proxy.run(self._commit, completions)
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


def _pump(
    stream: Iterator[Any],
    first: Any,
    index: int,
    queue: asyncio.Queue[tuple[int, Any]],
    loop: asyncio.AbstractEventLoop,
    stop: threading.Event,
) -> None:
    """Worker thread: forwards one engine stream to the event loop until it ends."""
    item = first
    try:
        while True:
            loop.call_soon_threadsafe(queue.put_nowait, (index, item))
            if isinstance(item, Completion):
                return
            if stop.is_set():
                getattr(stream, "close", lambda: None)()
                return
            item = next(stream)
    except Exception as error:
        loop.call_soon_threadsafe(queue.put_nowait, (index, error))


def _engine_error(error: Exception) -> api.ApiError:
    """What a client is told when the engine refuses or fails a request: a 400 for what the
    request asked (a prompt over the context, a budget an upstream refuses), a 502 for an
    engine that broke; never a 500."""
    message = str(error)
    status = getattr(error, "status", None)
    if isinstance(error, ValueError) or (isinstance(status, int) and 400 <= status < 500):
        code = "context_length_exceeded" if "context" in message else None
        return api.ApiError(400, message, param="messages", code=code)
    logger.error("the engine failed: %s", message)
    return api.ApiError(502, f"the engine failed: {message}", "server_error")


def _last(stream: Iterator[Any]) -> Completion:
    tail = collections.deque(stream, maxlen=1)
    item = tail[0] if tail else None
    if not isinstance(item, Completion):
        raise RuntimeError("the engine's stream ended without a completion")
    return item


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise api.ApiError(400, f"the body is not valid JSON: {error}") from error
    if not isinstance(body, dict):
        raise api.ApiError(400, "the body must be a JSON object")
    return body


def _build_app(proxy: Proxy) -> FastAPI:
    app = FastAPI(title="clawgym proxy", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = proxy
    _add_error_handlers(app)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "policy_version": proxy.engine.policy_version}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        proxy.check_key(request)
        created = int(time.time())
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": created, "owned_by": "clawgym"}
                for name in ("policy", "base")
            ],
        }

    async def chat_completions(request: Request) -> Response:
        proxy.check_key(request)
        return await proxy.chat(request)

    # A plain Starlette route: FastAPI's per-request dependency solving and response
    # wrapping is a tenth of a millisecond the hot path does not need.
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])

    @app.post("/admin/adapters")
    async def publish(request: Request) -> dict[str, Any]:
        proxy.check_key(request)
        body = _json_object(await request.body())
        path, version = body.get("path"), body.get("version")
        if not isinstance(path, str) or not isinstance(version, int) or isinstance(version, bool):
            raise api.ApiError(400, 'the body must be {"path": str, "version": int}')
        try:
            await proxy.run(proxy.publish_adapter, path, version)
        except Exception as error:  # a refused load leaves the previous version serving
            raise api.ApiError(409 if "newer" in str(error) else 400, str(error)) from error
        return {"policy_version": proxy.engine.policy_version}

    return app


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
