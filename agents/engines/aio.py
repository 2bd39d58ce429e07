"""Engines on an asyncio event loop: `agenerate` and `astream` of the engine interface.

The proxy serves every request on one event loop. A request that waits for a blocking
engine call on a worker thread pays two thread hand-offs (the wait starts on a worker, the
answer goes back to the loop), and under the GIL each hand-off can wait for the engine's
thread to let go: about half a millisecond apiece, measured here. The embedded engine
therefore delivers its tokens straight to the loop (`LoopSink`); engines whose calls block
anyway (HTTP to vLLM or a remote server) run them on a thread pool (`ThreadedAsync`).
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar

from agents.engines.base import (
    POLICY,
    Completion,
    Engine,
    Message,
    SamplingParams,
    TokenChunk,
    ToolSchema,
)

T = TypeVar("T")
MAX_THREADS = 256
"""Most blocking engine calls in flight at once (`ThreadedAsync`)."""


class LoopSink:
    """Items put from any thread, taken on the event loop that made the sink.

    Args:
        wake_on: which items wake the loop; the others wait in the sink until one that
            does (a reply that is not streamed needs only its end: one wake a request
            instead of one a token).
    """

    def __init__(self, wake_on: Callable[[Any], bool] = lambda item: True):
        self._loop = asyncio.get_running_loop()
        self._items: collections.deque[Any] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._wake_on = wake_on
        self._wake_pending = False

    def put(self, item: Any) -> None:
        """Any thread; never blocks. Several puts before the loop runs make one wake."""
        self._items.append(item)
        if self._wake_on(item) and not self._wake_pending:
            # The flag only saves wakes: a put that sees it set is appended before the
            # pending wake runs, so the taker that wake releases finds its item.
            self._wake_pending = True
            try:
                self._loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    def _wake(self) -> None:
        self._wake_pending = False
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[Any]:
        """Every item put so far (at least one), waiting for them if there are none."""
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                if not self._items:
                    await self._waiter
            finally:
                self._waiter = None
        items = list(self._items)
        for _ in items:
            self._items.popleft()
        return items


class ThreadedAsync(Engine):
    """`agenerate` and `astream` for an engine whose `generate` and `stream` block (HTTP to
    an upstream server): they run on threads of the engine's own pool, as many as there
    are requests in flight. `close` must call `_close_threads`."""

    _threads: ThreadPoolExecutor | None = None

    async def agenerate(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Completion:
        call = functools.partial(self.generate, messages, tools, sampling, adapter)
        return await asyncio.get_running_loop().run_in_executor(self._pool(), call)

    def astream(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> AsyncGenerator[TokenChunk | Completion, None]:
        call = functools.partial(self.stream, messages, tools, sampling, adapter)
        return threaded_stream(self._pool(), call)

    def _pool(self) -> ThreadPoolExecutor:
        if self._threads is None:
            # Threads start on demand; the bound only guards against a runaway client.
            self._threads = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="engine-call")
        return self._threads

    def _close_threads(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)


async def threaded_stream(
    pool: Executor, stream: Callable[[], Iterator[T]]
) -> AsyncGenerator[T, None]:
    """A blocking `stream` call's items, produced on a thread of `pool`. Closing the async
    iterator early closes the blocking one (which cancels its request)."""
    sink = LoopSink()
    stop = False
    done = object()

    def pump() -> None:
        try:
            items = stream()
            try:
                for item in items:
                    sink.put(item)
                    if stop:
                        break
            finally:
                getattr(items, "close", lambda: None)()
            sink.put(done)
        except BaseException as error:  # handed to the consumer, which raises it
            sink.put(_Failed(error))

    asyncio.get_running_loop().run_in_executor(pool, pump)
    try:
        while True:
            for item in await sink.take():
                if item is done:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                yield item
    finally:
        stop = True


class WholeReplies(ThreadedAsync):
    """For an engine that gets each reply whole (a Tinker service, a scripted agent):
    `stream` yields its tokens as one chunk, then the completion."""

    def stream(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Iterator[TokenChunk | Completion]:
        completion = self.generate(messages, tools, sampling, adapter)
        body = completion.message.get("content") or ""
        yield TokenChunk(completion.completion_token_ids, completion.completion_logprobs, body)
        yield completion


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error
