"""The remote engine: any OpenAI-compatible server, for evaluation (no training).

    engine = RemoteEngine("http://127.0.0.1:8000/v1", model="some-model", api_key="...")
    engine = RemoteEngine(url, model="tiny", token_ids=True)  # a vLLM server: token-exact

What it does: chat completions with tools, plain and streamed, through the same HTTP and
parsing code as the vLLM engine (`agents.engines.openai_http`). Tool calls come from the
server's structured `tool_calls` when it returns them, else from the text by
`agents.toolcalls`.

What it does not do: it serves one fixed model, so `adapter` may be `POLICY` or `None` and
both reach that model; `policy_version` is always 0 and `load_adapter` raises. Token ids and
log-probs are only what the server returns: with `token_ids=False` (the default, for servers
that refuse vLLM's extra request fields) `prompt_token_ids` and `completion_token_ids` are
empty tuples, and `completion_logprobs` too when the server gives no log-probs. Such
completions cannot be trained on; `token_exact` says which case an engine is in. `score` and
`encode` need a vLLM server (its `prompt_logprobs` and `/tokenize`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from agents.engines import openai_http
from agents.engines.aio import ThreadedAsync
from agents.engines.base import (
    BASE,
    POLICY,
    Completion,
    Message,
    SamplingParams,
    TokenChunk,
    ToolSchema,
    check_adapter,
    refuse_images,
)
from agents.engines.openai_http import (
    OpenAIHTTP,
    chat_body,
    completion_from_chat,
    stream_completion,
)


class RemoteEngine(ThreadedAsync):
    """An OpenAI-compatible server at `base_url` (see the module docstring).

    Args:
        base_url: the server's API root, e.g. "https://api.example.com/v1".
        model: the model name to request.
        api_key: sent as a bearer token when given.
        token_ids: ask for vLLM's `return_token_ids` (only for vLLM servers).
        logprobs: ask for per-token log-probs (OpenAI's `logprobs: true`).
        timeout: seconds one request may take.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        token_ids: bool = False,
        logprobs: bool = True,
        timeout: float = 600.0,
    ):
        self.model = model
        self.token_ids = token_ids
        self.logprobs = logprobs
        self._http = OpenAIHTTP(base_url, api_key=api_key, timeout=timeout)

    @property
    def token_exact(self) -> bool:
        """Whether completions carry the server's token ids and log-probs (trainable)."""
        return self.token_ids and self.logprobs

    @property
    def policy_version(self) -> int:
        return 0

    def generate(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Completion:
        body = self._body(messages, tools, sampling, adapter, stream=False)
        response = self._http.post("chat/completions", body)
        return completion_from_chat(response, 0, tools, self._top_k(sampling))

    def stream(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Iterator[TokenChunk | Completion]:
        body = self._body(messages, tools, sampling, adapter, stream=True)
        events = self._http.stream("chat/completions", body)
        yield from stream_completion(events, 0, tools, self._top_k(sampling))

    def _top_k(self, sampling: SamplingParams | None) -> int:
        """Top log-probs a position gets: only as token ids, which only a token-exact
        upstream names (`chat_body`); a plain OpenAI server's are strings, not ids."""
        exact = self.token_ids and self.logprobs
        return sampling.top_logprobs if sampling is not None and exact else 0

    def encode(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema] | None = None
    ) -> list[int]:
        """Prompt ids through vLLM's `/tokenize`; other servers answer with an error."""
        return openai_http.encode(self._http, self.model, messages, tools)

    def score(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        adapter: str | None = BASE,
        images: Sequence[bytes] = (),
    ) -> list[float]:
        """Log-probs through vLLM's `prompt_logprobs`; other servers answer with an error."""
        check_adapter(adapter, "remote engine")
        refuse_images(images, "remote engine")
        return openai_http.score(self._http, self.model, prompt_ids, completion_ids)

    def load_adapter(self, path: str, version: int) -> None:
        raise NotImplementedError(
            f"the remote engine serves the fixed model {self.model!r} and cannot load adapters; "
            "train with engine=vllm or engine=embedded"
        )

    def prepare_adapter(self, path: str) -> None:
        self.load_adapter(path, 0)  # the same refusal

    def close(self) -> None:
        self._close_threads()
        self._http.close()

    def _body(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None,
        sampling: SamplingParams | None,
        adapter: str | None,
        stream: bool,
    ) -> dict:
        check_adapter(adapter, "remote engine")
        return chat_body(
            self.model,
            messages,
            tools,
            sampling or SamplingParams(),
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            stream=stream,
        )
