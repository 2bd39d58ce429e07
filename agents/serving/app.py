"""The proxy's ASGI application (`build_app`): chat completions served directly, the other
routes by FastAPI.

Routes: `POST /v1/chat/completions` (plain, or real token-by-token server-sent events:
`agents.serving.chat_turn`), `GET /v1/models` (`policy`, and `base`: the adapter switched
off), `GET /healthz`, and `POST /admin/adapters` (`{"path", "version"}`) to publish a new
policy version (in process, `Proxy.publish_adapter` does the same), and the episode routes
of `agents.serving.episode_routes` (`POST /admin/sessions`, `POST /admin/sessions/{id}/end`),
through which a simulated episode's client tells the proxy its env, task, group, rewards
and last observation, so that training's own rollouts are recorded by the proxy like any
client's turns.

Bad input is a 4xx with OpenAI's error body (`agents.serving.chat_request` validates
requests, `agents.serving.openai_api` builds errors and responses).

The admin routes change what is served and what is trained on, so they need more than
loopback: any web page open on this machine can reach loopback (a `text/plain` POST is sent
cross-site without asking). An admin request needs the admin key and a JSON body
(`Proxy.check_admin`), and no route sends CORS headers; and any request from a web page (an
`Origin` header, or `Sec-Fetch-Site` other than `none`) is refused with a 403, so a page can
neither call the proxy nor, through DNS rebinding, read from it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from agents.engines.base import BASE
from agents.serving import openai_api as api
from agents.serving.chat_request import ChatRequest, validation_message
from agents.serving.chat_turn import ChatTurn
from agents.serving.episode_routes import add_episode_routes
from agents.serving.identity import SessionRefused, identify
from agents.serving.proxy import Proxy
from agents.trajectory import TurnType

logger = logging.getLogger(__name__)


def build_app(proxy: Proxy) -> ASGIApp:
    """The ASGI application that serves `proxy`."""
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
        proxy.adapter(name)  # a 404 for a model this server does not serve
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
        response = await _chat(proxy, headers, body, scope, receive)
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


async def _chat(
    proxy: Proxy, headers: Mapping[str, str], raw: bytes, scope: Scope, receive: Receive
) -> ASGIApp:
    """The response to a chat-completions request (`headers` with lower-case names);
    `scope` and `receive` tell when the client leaves."""
    chat = _chat_request(raw)
    try:  # the body's session fields are extra fields of the request: identify pops them
        info = identify(
            headers, chat.model_extra or {}, proxy.config.default_turn_type, proxy.home, proxy.users
        )
    except SessionRefused as error:
        raise api.ApiError(400, str(error), param=error.param) from error
    adapter = proxy.adapter(chat.model)
    if adapter is BASE:
        info = replace(info, turn_type=TurnType.SIDE)  # the base model is never trained
    proxy.expire_sessions()
    turn = ChatTurn(proxy, chat, info, adapter)
    if chat.stream:
        firsts = await turn.start_streams()
        return StreamingResponse(
            turn.events(firsts),
            media_type="text/event-stream",
            headers={"X-Session-Id": turn.info.session_id},
        )
    payload = await turn.complete(scope, receive)
    return _Json(payload, session_id=turn.info.session_id, turn_index=turn.first_index)


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
