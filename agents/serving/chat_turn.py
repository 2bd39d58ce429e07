"""One chat-completions request from validation to its committed turns (`ChatTurn`):
sampled plain, or streamed as real token-by-token server-sent events.

Every main turn is committed to the store, token-exactly with its policy version, before
its response completes (for a stream, before the chunk carrying `finish_reason`, so before
`[DONE]`); `agents.serving.sessions` says how sessions, side turns and next states work. A
client that leaves cancels its engine requests: nothing is sampled for nobody. An engine
that refuses a request is a 400 to the client, one that breaks a 502, never a 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Sequence
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope

from agents.engines.base import Completion, ContextExceeded, SamplingParams, TokenChunk
from agents.serving import openai_api as api
from agents.serving.chat_request import ChatRequest
from agents.serving.http_protocol import CONNECTION_LOST
from agents.serving.identity import SessionEnded, SessionInfo, SessionNotOwned
from agents.serving.proxy import Proxy
from agents.vision import BadImage, images_of

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ChatTurn:
    """One chat-completions request from validation to its committed turns."""

    def __init__(self, proxy: Proxy, chat: ChatRequest, info: SessionInfo, adapter: str | None):
        self.proxy, self.chat, self.info, self.adapter = proxy, chat, info, adapter
        self.messages = [m.for_engine() for m in chat.messages]
        try:  # decoded here for their limits; the engine and the store decode them again
            images_of(self.messages, proxy.config.image_limits())
        except BadImage as error:
            raise api.ApiError(400, str(error), param="messages", code="invalid_image") from None
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
                # what the client asks for, and at least what a stored turn keeps
                top_logprobs=max(chat.top_logprobs or 0, self.proxy.config.top_logprobs),
            )
        except ValueError as error:
            raise api.ApiError(400, str(error)) from error

    async def _begin(self) -> None:
        """Registers the request with its session (and links the session's previous turn)."""
        await self.proxy.checkpoints.writable()
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
        await self.proxy.checkpoints.writable()
        self.first_index = self.proxy.sessions.commit(
            self.info, self.messages, completions, replies, self.tools or ()
        )
        self.proxy.checkpoints.wrote(len(completions))
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
                        extra["logprobs"] = api.token_logprobs(item, chat.top_logprobs)
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
    """One server-sent event carrying `payload` as compact JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
