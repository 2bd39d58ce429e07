"""The embedded engine: transformers (+ peft for adapters) in this process, for CPU machines.

One copy of the weights serves the policy (through the LoRA adapter, once one is loaded)
and the self-judge / teacher (`adapter=None`, the adapter switched off). Concurrent
requests are batched together by `agents.engines.batching.Scheduler` (continuous batching
on one thread, base and policy rows in the same forward pass, prompts prefilled after the
longest prefix whose KV it already holds); its docstring says how and why. An adapter
swap is atomic: a request runs start to finish on the version it began with; publishing
copies the new weights into a preallocated slot (`agents.engines.lora_slots`).

Attention is transformers' sdpa without its copy of grouped KV heads at each step
(`agents.engines.attention`).

A vision-language model (`agents.models.is_vision`) takes image parts: a request with images
runs alone between two steps of the batch (`agents.engines.vision_decode` says why), its
placeholders expanded and its pixels preprocessed by `agents.vision`; the ids it returns are
the expanded prompt the model ran on. A text model refuses images (a `ValueError`).

Log-probs are the model's raw ones (log-softmax of the logits at temperature 1, before
temperature and top-p), as vLLM reports them by default, so that the learner's recomputed
log-probs are comparable with the rollout's.

A prompt longer than the context is refused (`ContextExceeded`) before it is queued: by its
tokens, or, before tokenizing it, by its characters where they cannot fit whatever the
tokens (`agents.engines.char_bound`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from typing import Any

import torch

from agents import models, vision
from agents.config import PREFIX_CACHE_TOKENS
from agents.engines import template
from agents.engines.aio import LoopSink
from agents.engines.attention import use_grouped_sdpa
from agents.engines.base import (
    BASE,
    POLICY,
    Completion,
    ContextExceeded,
    Message,
    SamplingParams,
    TokenChunk,
    ToolSchema,
    check_adapter,
    completion_room,
)
from agents.engines.batch import END, PREFILL_PASS_TOKENS, EventSink, Request
from agents.engines.batching import Scheduler
from agents.engines.char_bound import char_bound, request_chars
from agents.engines.detokenize import Detokenizer
from agents.engines.vision_decode import decode_alone

logger = logging.getLogger(__name__)


class EmbeddedEngine:
    """transformers + peft in process, requests batched continuously.

    Args:
        model: a model name or directory, as `agents.models.resolve` takes it.
        threads: torch CPU threads (None leaves torch's default).
        max_batch: most sequences decoded together in one forward pass.
        context_length: the longest prompt plus completion served; None: the model's
            `max_position_embeddings`. Longer runs a RoPE model on positions it was never
            trained on: only for test models such as `tiny`, to serve long-prompt clients
            (OpenClaw's prompt is over 14k tokens).
        prefix_cache_tokens: most tokens whose KV is kept for later prompts that start with
            them (0: every prompt is prefilled whole).
        merge_lora: whether a batch whose rows all run on one adapter runs on that
            adapter's merged weights, without peft's LoRA layers (`agents.engines.
            merged_lora`).
        share_prefixes: whether rows decoded together read the prompt prefix they have in
            common (a system prompt, tool schemas) from one copy of its KV instead of each
            row's own (`agents.engines.batch`; CPU only, not for vision-language models). Off
            by default: faster decode steps, but a main-job evaluation as a whole
            not yet faster (docs/results.md).
        split_prefills: whether requests that arrive together are prefilled in passes of
            similar widths (`agents.engines.batch.prefill_passes`), not all in one.
    """

    def __init__(
        self,
        model: str = "tiny",
        threads: int | None = None,
        max_batch: int = 32,
        context_length: int | None = None,
        prefix_cache_tokens: int = PREFIX_CACHE_TOKENS,
        image_limits: vision.ImageLimits | None = None,
        merge_lora: bool = True,
        share_prefixes: bool = False,
        split_prefills: bool = True,
    ):
        if threads is not None:
            torch.set_num_threads(threads)
        if context_length is not None and context_length < 2:
            raise ValueError(f"context_length must be at least 2, got {context_length}")
        self.model_name = model
        self.model, self.tokenizer = models.load(model)
        self.pixels = vision.Pixels(models.resolve(model)) if models.is_vision(model) else None
        """The image processor of a vision-language model, its outputs cached per image."""
        self.image_limits = image_limits or vision.ImageLimits()
        """What one request may carry; more is a `vision.BadImage` (a ValueError)."""
        use_grouped_sdpa(self.model)  # no copy of the KV cache per decode step
        self.context_length = context_length or int(
            self.model.config.get_text_config().max_position_embeddings
        )
        self._char_bound = char_bound(self.tokenizer)
        self._scheduler = Scheduler(
            self.model,
            self._eos_ids(),
            max_batch,
            threads,
            prefix_cache_tokens,
            torch.tensor(vision.markup_ids(self.model.config)) if self.pixels else None,
            merge_lora,
            share_prefixes and self.pixels is None,
            PREFILL_PASS_TOKENS if split_prefills else None,
        )

    @property
    def policy_version(self) -> int:
        return self._scheduler.adapters.policy[1]

    def prefill_counts(self) -> tuple[int, int, int]:
        """(prompt tokens prefilled so far, those of them whose KV the prefix cache gave,
        columns the prefill passes computed: the other prompt tokens and their padding)."""
        scheduler = self._scheduler
        return scheduler.prompt_tokens, scheduler.cached_tokens, scheduler.computed_tokens

    @property
    def _peft(self) -> Any:
        return self._scheduler.adapters.peft

    def generate(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Completion:
        events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        request = self._submit(messages, tools, sampling, adapter, events)
        *_, completion = self._events(request, events, False, tools)
        assert isinstance(completion, Completion)
        return completion

    def stream(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Iterator[TokenChunk | Completion]:
        """Queues the request at once (bad input raises here, not on the first `next`);
        closing the iterator early cancels it."""
        events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        request = self._submit(messages, tools, sampling, adapter, events)
        return self._events(request, events, True, tools)

    def _submit(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None,
        sampling: SamplingParams | None,
        adapter: str | None,
        events: EventSink,
    ) -> Request:
        sampling = sampling or SamplingParams()
        check_adapter(adapter, "embedded engine")
        self._refuse_overlong(messages, tools)
        images = vision.images_of(messages, self.image_limits)
        prompt_ids = self.encode(messages, tools, images)
        room = completion_room(len(prompt_ids), self.context_length)
        if images:
            return self._submit_alone(prompt_ids, sampling, room, adapter, events, images)
        return self._scheduler.submit(
            prompt_ids,
            sampling,
            min(sampling.max_tokens, room),
            self._stop_check(sampling.stop),
            use_policy=adapter == POLICY,
            events=events,
        )

    def _submit_alone(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        room: int,
        adapter: str | None,
        events: EventSink,
        images: list[bytes],
    ) -> Request:
        """Queues a prompt with images to run alone (`agents.engines.vision_decode`)."""
        assert self.pixels is not None  # `encode` refused images without a processor
        pixels = self.pixels(images)
        assert pixels is not None
        slot, version = self._scheduler.bind_policy() if adapter == POLICY else (None, 0)
        generator = None if sampling.seed is None else torch.Generator().manual_seed(sampling.seed)
        request = Request(
            prompt_ids,
            sampling,
            min(sampling.max_tokens, room),
            self._stop_check(sampling.stop),
            slot,
            version,
            events,
            generator,
        )

        def run() -> None:  # on the scheduler thread
            try:
                model, extra = self._scheduler.adapters.lora_model([slot])
                decode_alone(model, extra, request, pixels, self._eos_ids(), self._scheduler.banned)
            except Exception as error:
                logger.exception("sampling a request with images failed")
                events.put(error)
            finally:
                self._scheduler.release(slot)

        self._scheduler.post(run)
        return request

    def _refuse_overlong(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema] | None
    ) -> None:
        """Refuses, before tokenizing it, a prompt with more characters than the context's
        tokens can hold: tokenizing takes most of a second a megabyte (13 s for 20 MB on
        SmolLM2's tokenizer, measured), on the proxy's event loop.

        Counting the request's strings takes microseconds. Only a request whose count is over
        the bound is rendered (under a millisecond a megabyte), and refused if its rendered
        text is over the bound too: a template may leave out part of a request (an image, a
        past turn's reasoning), so only the rendered text tests it exactly.
        """
        bound = self._char_bound
        if bound is None:
            return
        if (
            request_chars(messages) + request_chars(tools)
            <= (self.context_length - 1) * bound.per_token
        ):
            return
        text = template.render(self.tokenizer, messages, tools, tokenize=False)
        if (least := bound.least_tokens(text)) >= self.context_length:
            raise ContextExceeded(
                f"the prompt has {len(text)} characters, at least {least} tokens (a token is "
                f"at most {bound.per_token} characters); the model's context is "
                f"{self.context_length}: shorten the conversation"
            )

    def _events(
        self,
        request: Request,
        events: queue.SimpleQueue[Any],
        deltas: bool,
        tools: Sequence[ToolSchema] | None,
    ) -> Iterator[TokenChunk | Completion]:
        """The request's tokens as they come (with their text when `deltas`), then its
        completion."""
        reply = _Reply(self, request, deltas, tools)
        try:
            while (item := events.get()) is not END:
                if (chunk := reply.add(item)) is not None:
                    yield chunk
        finally:
            request.cancelled = True  # a no-op once finished; frees the row if abandoned
        if (tail := reply.tail()) is not None:
            yield tail
        yield reply.completion()

    async def agenerate(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Completion:
        """`generate` on an event loop: the scheduler wakes the loop once, at the end."""
        sink = LoopSink(wake_on=lambda item: item is END or isinstance(item, BaseException))
        reply = _Reply(self, self._submit(messages, tools, sampling, adapter, sink), False, tools)
        async with contextlib.aclosing(self._aevents(reply, sink)) as items:
            async for item in items:  # without deltas, the completion is the only item
                assert isinstance(item, Completion)
                return item
        raise RuntimeError("the engine's stream ended without a completion")

    def astream(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> AsyncGenerator[TokenChunk | Completion, None]:
        """`stream` on an event loop (call it there): queues the request at once, and the
        scheduler hands each token to the loop; closing the iterator cancels the request."""
        sink = LoopSink()
        return self._aevents(
            _Reply(self, self._submit(messages, tools, sampling, adapter, sink), True, tools), sink
        )

    async def _aevents(
        self, reply: _Reply, sink: LoopSink
    ) -> AsyncGenerator[TokenChunk | Completion, None]:
        try:
            while True:
                for item in await sink.take():
                    if item is END:
                        if (tail := reply.tail()) is not None:
                            yield tail
                        yield reply.completion()
                        return
                    if (chunk := reply.add(item)) is not None:
                        yield chunk
        finally:
            reply.request.cancelled = True

    def _completion(
        self,
        prompt_ids: list[int],
        completion_ids: list[int],
        logprobs: list[float],
        sampling: SamplingParams,
        version: int,
        tools: Sequence[ToolSchema] | None,
    ) -> Completion:
        """The completion of a request (`agents.engines.template.token_completion`)."""
        return template.token_completion(
            self.tokenizer,
            self._eos_ids(),
            prompt_ids,
            completion_ids,
            logprobs,
            sampling,
            version,
            tools,
        )

    def encode(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        images: Sequence[bytes] | None = None,
    ) -> list[int]:
        """Prompt token ids of a conversation, ending with the assistant's generation prompt;
        each image's placeholder expanded to its tokens (`images`: the messages' images,
        decoded, when the caller has them)."""
        ids = template.encode(self.tokenizer, messages, tools)
        images = vision.images_of(messages, self.image_limits) if images is None else images
        if not images:
            return ids
        if self.pixels is None:
            raise ValueError(
                f"the model {self.model_name!r} takes no images: serve a vision-language "
                "model (model=tiny-vl, or a Qwen-VL checkpoint) or send text only"
            )
        return self.pixels.expanded(ids, images, self.model.config.image_token_id)

    def score(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        adapter: str | None = BASE,
        images: Sequence[bytes] = (),
    ) -> list[float]:
        """A vision-language model scores with the pixels and M-RoPE positions it samples
        with, its markup tokens masked as when sampling; its prompts' placeholders must
        match `images` (ValueError otherwise)."""
        check_adapter(adapter, "embedded engine")
        if images and self.pixels is None:
            raise ValueError(f"the model {self.model_name!r} takes no images")
        pixels = self.pixels(images) if self.pixels is not None else None
        ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
        # Bound like a request: a publish meanwhile never overwrites the slot it reads.
        slot = self._scheduler.bind_policy()[0] if adapter == POLICY else None
        try:
            return self._scheduler.call(lambda: self._score(ids, len(prompt_ids), slot, pixels))
        finally:
            self._scheduler.release(slot)

    def _score(
        self,
        ids: torch.Tensor,
        prompt_length: int,
        slot: str | None,
        pixels: vision.PixelInputs | None,
    ) -> list[float]:
        """Runs on the scheduler thread; `slot` None is the base model."""
        model, extra = self._scheduler.adapters.lora_model([slot])
        if self.pixels is not None:
            extra = {**extra, **vision.forward_inputs(model, ids, torch.ones_like(ids), pixels)}
        with torch.inference_mode():
            logits = model(input_ids=ids, **extra).logits
        logits = vision.masked_logits(
            logits[0, prompt_length - 1 : -1].float(), self._scheduler.banned
        )
        return (
            torch.log_softmax(logits, dim=-1)
            .gather(-1, ids[0, prompt_length:, None])[:, 0]
            .tolist()
        )

    def load_adapter(self, path: str, version: int) -> None:
        """Copies the adapter into a free slot and swaps atomically: running requests keep
        their version, later ones get this one (`agents.engines.batching`)."""
        self._scheduler.adapters.load_adapter(path, version)
        logger.info("serving adapter %s as policy version %d", path, version)

    def prepare_adapter(self, path: str) -> None:
        """Makes the LoRA slots of the adapter's shape now, without serving it."""
        self._scheduler.adapters.prepare_adapter(path)

    def close(self) -> None:
        self._scheduler.close()

    def _stop_check(self, stops: Sequence[str]) -> Callable[[list[int]], bool] | None:
        if not stops:
            return None
        longest = max(len(s) for s in stops)

        def stopped(ids: list[int]) -> bool:
            # A stop string spans at most `longest` characters, hence at most that many tokens.
            tail = self.tokenizer.decode(ids[-longest:])
            return any(s in tail for s in stops)

        return stopped

    def _eos_ids(self) -> set[int]:
        return template.id_set(self.model.generation_config.eos_token_id)


class _Reply:
    """A request's items as they arrive: token chunks (with text when `deltas`), then the
    completion."""

    def __init__(
        self,
        engine: EmbeddedEngine,
        request: Request,
        deltas: bool,
        tools: Sequence[ToolSchema] | None,
    ):
        self.engine, self.request, self.tools = engine, request, tools
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[tuple[tuple[int, ...], tuple[float, ...]]] = []
        self.text = Detokenizer(engine.tokenizer) if deltas else None
        self.eos = engine._eos_ids() if deltas else set()

    def add(self, item: Any) -> TokenChunk | None:
        """One item from the scheduler (not `END`): a (token, log-prob, top ids and log-probs
        or None) or an error, raised."""
        if isinstance(item, BaseException):
            raise item
        token, logprob, top = item
        self.ids.append(token)
        self.logprobs.append(logprob)
        if top is not None:
            self.tops.append(top)
        if self.text is None:
            return None
        # the end-of-sequence token is no text of the reply (the completion drops it too)
        text = "" if token in self.eos else self.text.push(token)
        if top is None:
            return TokenChunk((token,), (logprob,), text)
        return TokenChunk((token,), (logprob,), text, (top[0],), (top[1],))

    def tail(self) -> TokenChunk | None:
        """After the last token: the text held back as an incomplete character, which the
        completion's text has too (as U+FFFD), in a chunk of no tokens; None if nothing is."""
        if self.text is None or not (rest := self.text.rest()):
            return None
        return TokenChunk((), (), rest)

    def completion(self) -> Completion:
        request = self.request
        completion = self.engine._completion(
            request.prompt_ids,
            self.ids,
            self.logprobs,
            request.sampling,
            request.version,
            self.tools,
        )
        if not self.tops:
            return completion
        return dataclasses.replace(
            completion,
            top_ids=tuple(ids for ids, _ in self.tops),
            top_logprobs=tuple(values for _, values in self.tops),
        )
