"""OpenAI's chat-completions wire format, as the proxy speaks it: errors (`ApiError`, sent
as a 4xx with OpenAI's error body), responses and stream chunks. Requests are validated in
`agents.serving.chat_request`.

Responses and stream chunks are built from the engine's `Completion`s. Beyond OpenAI's
fields, `return_token_ids: true` adds vLLM's `prompt_token_ids` and per-choice
`token_ids`, and `logprobs: true` gives each sampled token's raw log-prob (and with
`top_logprobs: n` its position's n likeliest tokens, as OpenAI's API does) with vLLM's
`token_id:<id>` names, so a token-exact client (the `remote` engine) can use the proxy
like vLLM.

`ContentStream` decides what of a completion's text may be streamed as content while it is
sampled: nothing from a `<tool_call>` or a stop string on, so tool-call markup never leaks
into streamed content; the parsed tool calls are sent once the completion is complete.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agents.engines.base import Completion, TokenChunk
from agents.serving.chat_request import ChatRequest

TOOL_CALL_OPEN = "<tool_call>"


class ApiError(Exception):
    """A request the proxy refuses, with the HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status,
            message,
            kind,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        """OpenAI's error body."""
        return error_body(self.message, self.kind, self.param, self.code)


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object, or a 400 saying what is wrong."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as error:  # ValueError: bad JSON or bad UTF-8
        raise ApiError(400, f"the body is not valid JSON: {error}") from error
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def error_body(
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def choice_message(completion: Completion, call_prefix: str) -> dict[str, Any]:
    """The assistant message of a choice, with tool-call ids unique to this response."""
    message = dict(completion.message)
    calls = message.get("tool_calls")
    if calls:
        message["tool_calls"] = [
            {**call, "id": f"{call_prefix}_{i}"} for i, call in enumerate(calls)
        ]
    return message


def token_logprobs(sampled: Completion | TokenChunk, top: int | None = None) -> dict[str, Any]:
    """OpenAI's `logprobs` of sampled tokens (a choice's, or a stream chunk's): each one's
    log-prob and its position's `top` likeliest tokens (the request's `top_logprobs`; none
    when it gave none); tokens named `token_id:<id>` as vLLM does."""
    if isinstance(sampled, Completion):
        ids, logprobs = sampled.completion_token_ids, sampled.completion_logprobs
    else:
        ids, logprobs = sampled.token_ids, sampled.logprobs
    tops: Sequence[list[dict[str, Any]]] = [[] for _ in ids]
    if top:
        tops = [
            [
                {"token": f"token_id:{i}", "logprob": lp, "bytes": None}
                for i, lp in zip(ids_t[:top], values[:top], strict=True)
            ]
            for ids_t, values in zip(sampled.top_ids, sampled.top_logprobs, strict=True)
        ]
    return {
        "content": [
            {"token": f"token_id:{i}", "logprob": lp, "bytes": None, "top_logprobs": t}
            for i, lp, t in zip(ids, logprobs, tops, strict=True)
        ]
    }


def usage(completions: list[Completion]) -> dict[str, int]:
    prompt = len(completions[0].prompt_token_ids) if completions else 0
    generated = sum(len(c.completion_token_ids) for c in completions)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
    }


def response(
    request: ChatRequest,
    response_id: str,
    created: int,
    messages: list[dict[str, Any]],
    completions: list[Completion],
) -> dict[str, Any]:
    """The non-streaming `chat.completion` object."""
    choices = []
    for index, (message, completion) in enumerate(zip(messages, completions, strict=True)):
        choice: dict[str, Any] = {
            "index": index,
            "message": message,
            "finish_reason": completion.finish_reason,
            "logprobs": (
                token_logprobs(completion, request.top_logprobs) if request.logprobs else None
            ),
        }
        if request.return_token_ids:
            choice["token_ids"] = list(completion.completion_token_ids)
        choices.append(choice)
    body: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": request.model,
        "choices": choices,
        "usage": usage(completions),
    }
    if request.return_token_ids and completions:
        body["prompt_token_ids"] = list(completions[0].prompt_token_ids)
    return body


def chunk(
    request: ChatRequest,
    response_id: str,
    created: int,
    choices: list[dict[str, Any]],
    **extra: Any,
) -> dict[str, Any]:
    """One `chat.completion.chunk` of a stream."""
    return {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": request.model,
        "choices": choices,
        **extra,
    }


def stream_delta(
    index: int, delta: dict[str, Any], finish_reason: str | None = None, **extra: Any
) -> dict[str, Any]:
    return {
        "index": index,
        "delta": delta,
        "finish_reason": finish_reason,
        "logprobs": None,
        **extra,
    }


def tool_call_deltas(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A finished message's tool calls as stream deltas, one whole call each."""
    return [{**call, "index": i} for i, call in enumerate(message.get("tool_calls") or [])]


class ContentStream:
    """The part of a growing completion text that is safe to stream as content.

    What is sent is always a prefix of the final message's content: leading and trailing
    whitespace is held back (the final content is stripped), so is anything that may be
    the start of `<tool_call>` or of a stop string, and nothing after one of them is sent.
    """

    def __init__(self, stops: tuple[str, ...] = ()):
        self._markers = (TOOL_CALL_OPEN, *stops)
        self._text = ""
        self._sent = ""
        self._closed = False

    def feed(self, text: str) -> str:
        """Adds sampled text; returns the new content that may be sent now."""
        if self._closed or not text:
            return ""
        self._text += text
        found = [i for i in (self._text.find(m) for m in self._markers) if i >= 0]
        if found:
            self._closed = True
            end = min(found)
        else:
            end = len(self._text) - self._partial_marker()
        return self._advance(self._text[:end].strip())

    def finish(self, content: str | None) -> str:
        """The rest of the final content, once the completion is parsed."""
        self._closed = True
        return self._advance(content or "")

    def _advance(self, visible: str) -> str:
        if not visible.startswith(self._sent):
            return ""
        delta, self._sent = visible[len(self._sent) :], visible
        return delta

    def _partial_marker(self) -> int:
        """Length of the longest end of the text that could begin a marker."""
        for size in range(min(len(self._text), max(map(len, self._markers))), 0, -1):
            tail = self._text[-size:]
            if any(m.startswith(tail) for m in self._markers):
                return size
        return 0
