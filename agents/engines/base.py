"""The engine interface (docs/architecture.md, "Engine"): one contract for vLLM, embedded,
remote and Tinker.

An engine samples completions token-exactly: the ids and log-probs it returns are the
ones it sampled, so the learner can recompute log-probs on the very same ids.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

Message = Mapping[str, Any]
ToolSchema = Mapping[str, Any]

BASE = None
"""The `adapter` argument that switches the adapter off: the base model (self-judge, teacher)."""
POLICY = "policy"
"""The adapter name the trainer publishes to and the proxy serves by default."""
MAX_TOP_LOGPROBS = 20
"""The most top log-probs a position returns (OpenAI's bound on `top_logprobs`)."""


class ContextExceeded(ValueError):
    """A prompt past the engine's context (no room left for one completion token): bad
    input like any `ValueError`, and one a client can mend by shortening its history and
    asking again (`agents.rollout` elides old tool outputs). The proxy answers it with
    OpenAI's error code `context_length_exceeded`."""


def check_adapter(adapter: str | None, engine: str) -> None:
    """Refuses an `adapter` other than `POLICY` and `BASE` (an engine that serves one policy)."""
    if adapter not in (BASE, POLICY):
        raise ValueError(f"unknown adapter {adapter!r}; the {engine} serves {POLICY!r} or None")


def refuse_images(images: Sequence[bytes], engine: str) -> None:
    """ValueError for an engine that scores text only, asked to score with images."""
    if images:
        raise ValueError(
            f"the {engine} scores text only, not a prompt with {len(images)} images: score a "
            "vision-language policy's turns on the embedded engine"
        )


def completion_room(prompt_length: int, context_length: int) -> int:
    """How many tokens a completion may take after a prompt of `prompt_length` tokens;
    `ContextExceeded` if not even one."""
    room = context_length - prompt_length
    if room < 1:
        raise ContextExceeded(
            f"the prompt has {prompt_length} tokens; the model's context is "
            f"{context_length}: shorten the conversation"
        )
    return room


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion."""

    temperature: float = 0.6
    """0 means greedy."""
    top_p: float = 1.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0
    """How many of the likeliest tokens' ids and raw log-probs to return at each sampled
    position (0: none, and nothing is spent on them)."""

    def __post_init__(self) -> None:
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        if not 0.0 <= self.temperature <= 10.0:
            raise ValueError(f"temperature must be in [0, 10], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")


@dataclass(frozen=True)
class Completion:
    """One sampled assistant reply, token-exact."""

    message: Mapping[str, Any]
    """The assistant message: role, content and, when the model called tools, tool_calls."""
    prompt_token_ids: tuple[int, ...]
    completion_token_ids: tuple[int, ...]
    completion_logprobs: tuple[float, ...]
    finish_reason: str
    """"stop", "length" or "tool_calls", as in OpenAI's API."""
    policy_version: int
    """The adapter version that sampled it (0 for the base model)."""
    text: str = ""
    """The raw decoded completion, markup included."""
    usage: Mapping[str, int] = field(default_factory=dict)
    top_ids: tuple[tuple[int, ...], ...] = ()
    """With `SamplingParams.top_logprobs` k > 0: the k likeliest token ids at each sampled
    position, likeliest first (one tuple per completion token); () otherwise."""
    top_logprobs: tuple[tuple[float, ...], ...] = ()
    """Their raw log-probs, like `completion_logprobs`."""


@dataclass(frozen=True)
class TokenChunk:
    """Tokens sampled since the previous chunk of a stream."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    """Their decoded text; "" while a multi-byte character is still incomplete."""
    top_ids: tuple[tuple[int, ...], ...] = ()
    """As `Completion.top_ids`, for these tokens."""
    top_logprobs: tuple[tuple[float, ...], ...] = ()


class Engine(Protocol):
    """What every engine backend provides."""

    @property
    def policy_version(self) -> int:
        """The adapter version `adapter=POLICY` currently serves (0: none loaded yet)."""
        ...

    def generate(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Completion:
        """Samples one assistant reply to `messages`."""
        ...

    def stream(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Iterator[TokenChunk | Completion]:
        """Like `generate`, token by token: `TokenChunk`s as they are sampled, then the
        final `Completion` (always the last item, with every id and log-prob)."""
        ...

    async def agenerate(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Completion:
        """`generate` awaited on an event loop (the proxy's), which it never blocks for
        the sampling."""
        ...

    def astream(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> AsyncGenerator[TokenChunk | Completion, None]:
        """`stream` on an event loop (called there); closing it early cancels the request."""
        ...

    def encode(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema] | None = None
    ) -> list[int]:
        """Prompt token ids of a conversation under the served chat template, ending with the
        assistant's generation prompt: what `generate` would feed the model. The judge's
        teacher uses it to render a hint-augmented prompt."""
        ...

    def score(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        adapter: str | None = BASE,
        images: Sequence[bytes] = (),
    ) -> list[float]:
        """Log-prob of each completion token after the prompt; `images`, decoded, are the
        prompt's (a vision-language model's placeholders in `prompt_ids` are theirs).
        An engine that scores text only raises ValueError for images (`refuse_images`)."""
        ...

    def load_adapter(self, path: str, version: int) -> None:
        """Serves the LoRA adapter at `path` as version `version` of the policy."""
        ...

    def prepare_adapter(self, path: str) -> None:
        """Gets ready for adapters shaped like the one at `path` without serving it, so that
        the first publish is as fast as every later one (a no-op for engines where each
        load costs the same)."""
        ...

    def close(self) -> None:
        """Releases the engine's resources; idempotent."""
        ...
