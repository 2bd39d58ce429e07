"""HTTP and response parsing for OpenAI-compatible servers: the one place the `vllm` and
`remote` engines share.

`OpenAIHTTP` posts JSON (plain or as a server-sent-event stream) and turns error responses
into `ServerError`. The functions below build `/v1/chat/completions` and `/v1/completions`
bodies from the engine interface's arguments and turn responses back into `Completion`s.

Token ids and log-probs are taken from the response, never from re-tokenizing its text:
vLLM returns them with `return_token_ids` (top-level `prompt_token_ids`, `token_ids` on each
choice; in a stream the prompt ids come in the first chunk and new ids in each chunk) and
`logprobs` as OpenAI's API does. A server that returns neither gives empty tuples. Tool calls
are parsed from the completion text with `agents.toolcalls`, the chat template's convention,
unless the server already returned structured `tool_calls`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import httpx

from agents.engines.base import (
    Completion,
    ContextExceeded,
    Message,
    SamplingParams,
    TokenChunk,
    ToolSchema,
)
from agents.toolcalls import assistant_message

logger = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """An error response from the server (`status` is its HTTP status, 0 if unreachable)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"server answered {status}: {message}" if status else message)
        self.status = status
        self.message = message


class BadRequestError(ServerError, ValueError):
    """The server refused the request itself (a 400-class answer: a prompt over the context,
    a bad tool schema, an unknown model): a `ValueError`, as engines raise for bad input."""


class ContextError(BadRequestError, ContextExceeded):
    """The server refused a prompt past its context."""


CONTEXT_REFUSALS = ("context_length_exceeded", "context length", "maximum model length")
"""How servers say a prompt is past the context: OpenAI's API and this repo's proxy by the
error code `context_length_exceeded`, vLLM only in its message ("This model's maximum context
length is 4096 tokens", "longer than the maximum model length of 4096")."""


KEEPALIVE_S = 2.0
"""How long an idle connection is kept for the next request."""


class OpenAIHTTP:
    """A small synchronous client for one OpenAI-compatible base URL (ending in `/v1`).

    Args:
        base_url: e.g. "http://127.0.0.1:8000/v1".
        api_key: sent as a bearer token when given.
        timeout: seconds for one request (a whole completion, not one token).
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        # Enough connections for every request a proxy keeps in flight at once. An idle
        # connection is dropped after 2 s: servers on uvicorn (vLLM's) close theirs after
        # 5 s, httpx's own default, and a request sent on a connection as the server closes
        # it fails ("Server disconnected without sending a response").
        limits = httpx.Limits(
            max_connections=512, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S
        )
        self._client = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout, limits=limits
        )

    @property
    def root(self) -> str:
        """The server's root URL: the base URL without its trailing `/v1`."""
        return self.base_url.removesuffix("/v1")

    def get(self, path: str) -> Any:
        """GET `path` (relative to the base URL) and decode its JSON body."""
        return _decoded(self._send(lambda: self._client.get(path.lstrip("/"))))

    def post(self, path: str, body: Mapping[str, Any]) -> Any:
        """POST a JSON body and decode the JSON answer (None when the answer is not JSON)."""
        return _decoded(self._send(lambda: self._client.post(path.lstrip("/"), json=body)))

    def stream(self, path: str, body: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        """POST with `stream: true` and yield each server-sent event's JSON payload."""
        request = self._client.build_request("POST", path.lstrip("/"), json=dict(body))
        try:
            response = self._client.send(request, stream=True)
        except httpx.HTTPError as error:
            raise ServerError(0, f"cannot reach {self.base_url}: {error}") from error
        try:
            if response.status_code >= 400:
                response.read()
                raise _error_of(response)
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if isinstance(event, dict) and event.get("error"):  # failed mid-stream
                    raise _event_error(event["error"])
                yield event
        finally:
            response.close()

    def close(self) -> None:
        self._client.close()

    def _send(self, call: Any) -> httpx.Response:
        try:
            response = call()
        except httpx.HTTPError as error:
            raise ServerError(0, f"cannot reach {self.base_url}: {error}") from error
        if response.status_code >= 400:
            raise _error_of(response)
        return response


def _decoded(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _event_error(error: Any) -> ServerError:
    if not isinstance(error, dict):
        return ServerError(0, str(error))
    code = error.get("code")
    status = code if isinstance(code, int) else 0
    return _refusal(status, str(error.get("message", error)), code)


def _error_of(response: httpx.Response) -> ServerError:
    """The server's own error message: OpenAI's `{"error": {"message": ...}}` or the text."""
    try:
        body = response.json()
    except ValueError:
        return _refusal(response.status_code, response.text.strip()[:2000])
    error = body.get("error", body) if isinstance(body, dict) else body
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(error, dict):
        error = error.get("message", error)
    return _refusal(response.status_code, str(error)[:2000], code)


def _refusal(status: int, message: str, code: Any = None) -> ServerError:
    """The error of an answer: a `BadRequestError` for a 400-class one (a `ContextError`
    where the server says the prompt is past its context), else a `ServerError`."""
    if status not in (400, 404, 413, 422):
        return ServerError(status, message)
    said = f"{code} {message}".lower()
    kind = ContextError if any(c in said for c in CONTEXT_REFUSALS) else BadRequestError
    return kind(status, message)


def chat_body(
    model: str,
    messages: Sequence[Message],
    tools: Sequence[ToolSchema] | None,
    sampling: SamplingParams,
    *,
    token_ids: bool,
    logprobs: bool,
    stream: bool = False,
) -> dict[str, Any]:
    """A `/v1/chat/completions` body.

    Args:
        token_ids: ask for vLLM's `return_token_ids` (a vLLM extension; other servers may
            refuse unknown fields). With it, tools are rendered by the chat template and the
            server is told not to parse calls itself (`tool_choice: "none"`): the caller
            parses them from the text, so every engine parses them the same way.
        logprobs: ask for per-token log-probs (OpenAI's `logprobs: true`); with `token_ids`
            and `sampling.top_logprobs` k > 0, also each position's top k, as ids (vLLM's
            `return_tokens_as_token_ids`) and asked for as k + 1: vLLM's list starts with
            the sampled token and cuts at the number asked, so with k it would hold the top
            k - 1 only, wherever the sampled token ranks below k (`top_entries` takes k).
    """
    body: dict[str, Any] = {
        "model": model,
        "messages": [dict(m) for m in messages],
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
        "stream": stream,
    }
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if tools:
        body["tools"] = [dict(t) for t in tools]
        if token_ids:
            body["tool_choice"] = "none"
    if logprobs:
        body["logprobs"] = True
        if token_ids and sampling.top_logprobs:
            body["top_logprobs"] = sampling.top_logprobs + 1
            body["return_tokens_as_token_ids"] = True
    if token_ids:
        body["return_token_ids"] = True
        # Markup tokens stay in the text, as the embedded engine decodes them.
        body["skip_special_tokens"] = False
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def completion_from_chat(
    response: Mapping[str, Any],
    policy_version: int,
    tools: Sequence[ToolSchema] | None,
    top_k: int = 0,
) -> Completion:
    """A `Completion` from a non-streamed chat completion (its first choice) to a request
    that offered `tools` (and asked for `top_k` top log-probs a position)."""
    choice = _first_choice(response)
    message = choice.get("message") or {}
    logprobs, raw = _logprobs_of(choice)
    top_ids, top_logprobs = top_entries(choice, top_k)
    completion = _completion(
        content=message.get("content") or "",
        raw=raw,
        server_calls=message.get("tool_calls"),
        prompt_ids=response.get("prompt_token_ids") or (),
        completion_ids=choice.get("token_ids") or (),
        logprobs=logprobs,
        finish_reason=choice.get("finish_reason"),
        usage=response.get("usage"),
        policy_version=policy_version,
        tools=tools,
    )
    return dataclasses.replace(completion, top_ids=top_ids, top_logprobs=top_logprobs)


def stream_completion(
    events: Iterator[Mapping[str, Any]],
    policy_version: int,
    tools: Sequence[ToolSchema] | None,
    top_k: int = 0,
) -> Iterator[TokenChunk | Completion]:
    """`TokenChunk`s from streamed chat-completion chunks, then the final `Completion`, of a
    request that offered `tools` (and asked for `top_k` top log-probs a position)."""
    prompt_ids: list[int] = []
    ids: list[int] = []
    logprobs: list[float] = []
    top_ids: list[tuple[int, ...]] = []
    top_logprobs: list[tuple[float, ...]] = []
    texts: list[str] = []
    raw = bytearray()
    calls: list[Any] = []
    finish_reason = None
    usage = None
    for event in events:
        prompt_ids = list(event.get("prompt_token_ids") or prompt_ids)
        usage = event.get("usage") or usage
        if not event.get("choices"):
            continue
        choice = event["choices"][0]
        delta = choice.get("delta") or {}
        chunk_logprobs, chunk_raw = _logprobs_of(choice)
        chunk = TokenChunk(
            tuple(choice.get("token_ids") or ()),
            chunk_logprobs,
            delta.get("content") or "",
            *top_entries(choice, top_k),
        )
        top_ids.extend(chunk.top_ids)
        top_logprobs.extend(chunk.top_logprobs)
        raw.extend(chunk_raw)
        calls.extend(delta.get("tool_calls") or ())
        finish_reason = choice.get("finish_reason") or finish_reason
        ids.extend(chunk.token_ids)
        logprobs.extend(chunk.logprobs)
        texts.append(chunk.text)
        if chunk.token_ids or chunk.text:
            yield chunk
    completion = _completion(
        content="".join(texts),
        raw=bytes(raw),
        server_calls=_merged_stream_calls(calls),
        prompt_ids=prompt_ids,
        completion_ids=ids,
        logprobs=tuple(logprobs),
        finish_reason=finish_reason,
        usage=usage,
        policy_version=policy_version,
        tools=tools,
    )
    yield dataclasses.replace(completion, top_ids=tuple(top_ids), top_logprobs=tuple(top_logprobs))


def encode(
    http: OpenAIHTTP, model: str, messages: Sequence[Message], tools: Sequence[ToolSchema] | None
) -> list[int]:
    """Prompt ids of a conversation as a vLLM server's chat endpoint renders them."""
    response = http.post(f"{http.root}/tokenize", _tokenize_body(model, messages, tools))
    return [int(i) for i in response["tokens"]]


def score(
    http: OpenAIHTTP, model: str, prompt_ids: Sequence[int], completion_ids: Sequence[int]
) -> list[float]:
    """Log-probs of `completion_ids` after `prompt_ids`, from a vLLM server."""
    if not completion_ids:
        return []
    response = http.post("completions", _score_body(model, prompt_ids, completion_ids))
    return _scored_logprobs(response, prompt_ids, completion_ids)


def _tokenize_body(
    model: str, messages: Sequence[Message], tools: Sequence[ToolSchema] | None
) -> dict[str, Any]:
    """A body for vLLM's `/tokenize` (at the server's root, beside `/v1`)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [dict(m) for m in messages],
        "add_generation_prompt": True,
    }
    if tools:
        body["tools"] = [dict(t) for t in tools]
    return body


def _score_body(model: str, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> dict:
    """A `/v1/completions` body that asks for the log-prob of every prompt token (vLLM's
    `prompt_logprobs`) on the token-id prompt `prompt_ids + completion_ids`."""
    return {
        "model": model,
        "prompt": [int(i) for i in (*prompt_ids, *completion_ids)],
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 0,
    }


def _scored_logprobs(
    response: Mapping[str, Any], prompt_ids: Sequence[int], completion_ids: Sequence[int]
) -> list[float]:
    """The completion tokens' log-probs out of a `_score_body` response."""
    entries = _first_choice(response).get("prompt_logprobs") or response.get("prompt_logprobs")
    if not entries:
        raise ServerError(0, "the server returned no prompt_logprobs; scoring needs vLLM")
    scored = []
    for position, token in enumerate(completion_ids, start=len(prompt_ids)):
        entry = entries[position] or {}
        found = entry.get(str(int(token)))
        if found is None:
            raise ServerError(0, f"no prompt log-prob for token {token} at position {position}")
        scored.append(float(found["logprob"] if isinstance(found, dict) else found))
    return scored


def _first_choice(response: Mapping[str, Any]) -> Mapping[str, Any]:
    choices = response.get("choices") or []
    if not choices:
        raise ServerError(0, f"the server returned no choices: {str(response)[:500]}")
    return choices[0]


def _logprobs_of(choice: Mapping[str, Any]) -> tuple[tuple[float, ...], bytes]:
    """Each sampled token's log-prob, and the tokens' own bytes joined (markup included:
    the end-of-turn token is in the ids but never in the message content)."""
    content = (choice.get("logprobs") or {}).get("content") or ()
    raw = b"".join(bytes(entry.get("bytes") or entry["token"].encode()) for entry in content)
    return tuple(float(entry["logprob"]) for entry in content), raw


def top_entries(
    choice: Mapping[str, Any], k: int
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[float, ...], ...]]:
    """Each sampled position's k likeliest ids and log-probs, likeliest first, from a
    choice's `top_logprobs` named `token_id:<id>` (vLLM's `return_tokens_as_token_ids`);
    ((), ()) for k = 0. Sorted here: the list may begin with the sampled token."""
    if not k:
        return (), ()
    ids, values = [], []
    for entry in (choice.get("logprobs") or {}).get("content") or ():
        tops = sorted(entry.get("top_logprobs") or (), key=lambda top: -float(top["logprob"]))
        if len(tops) < k:
            raise ServerError(0, f"asked for {k} top log-probs, the server sent {len(tops)}")
        ids.append(tuple(_token_id(top["token"]) for top in tops[:k]))
        values.append(tuple(float(top["logprob"]) for top in tops[:k]))
    return tuple(ids), tuple(values)


def _token_id(name: str) -> int:
    prefix, _, number = name.partition(":")
    if prefix != "token_id" or not number.isdigit():
        raise ServerError(0, f"a top log-prob names {name!r}, not token_id:<id>")
    return int(number)


def _merged_stream_calls(deltas: list[Any]) -> list[dict[str, Any]] | None:
    """Structured tool calls from a stream's deltas (OpenAI sends each call in pieces)."""
    merged: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        call = merged.setdefault(
            delta.get("index", len(merged)),
            {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
        )
        call["id"] = delta.get("id") or call["id"]
        function = delta.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""
    return [merged[i] for i in sorted(merged)] or None


def _completion(
    *,
    content: str,
    raw: bytes,
    server_calls: Any,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    logprobs: tuple[float, ...],
    finish_reason: str | None,
    usage: Mapping[str, Any] | None,
    policy_version: int,
    tools: Sequence[ToolSchema] | None,
) -> Completion:
    if server_calls:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content or None,
            "tool_calls": list(server_calls),
        }
    else:
        message = assistant_message(content, tools)
    if message.get("tool_calls"):
        finish_reason = "tool_calls"
    counts = {
        "prompt_tokens": int((usage or {}).get("prompt_tokens", len(prompt_ids))),
        "completion_tokens": int((usage or {}).get("completion_tokens", len(completion_ids))),
    }
    return Completion(
        message=message,
        prompt_token_ids=tuple(int(i) for i in prompt_ids),
        completion_token_ids=tuple(int(i) for i in completion_ids),
        completion_logprobs=logprobs,
        finish_reason=finish_reason or "length",
        policy_version=policy_version,
        text=raw.decode("utf-8", errors="replace") if raw else content,
        usage=counts,
    )
