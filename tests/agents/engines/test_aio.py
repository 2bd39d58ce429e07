"""Engines on an event loop: the sink that carries items from an engine thread to the
loop, the thread pool that runs blocking engines, and the embedded engine's native path."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from agents.engines.aio import LoopSink, ThreadedAsync, threaded_stream
from agents.engines.base import SamplingParams

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def test_sink_delivers_every_item_in_order_from_another_thread():
    async def main():
        sink = LoopSink()
        thread = threading.Thread(target=lambda: [sink.put(i) for i in range(2000)])
        thread.start()
        taken = []
        while len(taken) < 2000:
            taken += await sink.take()
        thread.join()
        return taken

    assert asyncio.run(main()) == list(range(2000))


def test_sink_wakes_the_loop_only_for_the_items_that_ask():
    async def main():
        sink = LoopSink(wake_on=lambda item: item == "end")
        woken = []
        waiter = asyncio.ensure_future(sink.take())
        await asyncio.sleep(0)  # the taker waits on an empty sink
        sink.put(1)
        sink.put(2)
        await asyncio.sleep(0.05)  # no wake for plain items: the taker still waits
        woken.append(waiter.done())
        threading.Thread(target=sink.put, args=("end",)).start()
        woken.append(await asyncio.wait_for(waiter, 5))
        return woken

    assert asyncio.run(main()) == [False, [1, 2, "end"]]


def test_sink_put_after_the_loop_closed_is_harmless():
    async def make():
        return LoopSink()

    sink = asyncio.run(make())
    sink.put("late")  # the engine thread finishing after its client's loop is gone


def _blocking_items(closed: list[str]):
    try:
        for item in ("a", "b", "c", "d"):
            time.sleep(0.01)
            yield item
    finally:
        closed.append(threading.current_thread().name)


def test_threaded_stream_yields_a_blocking_iterator_and_closes_it_when_left_early():
    from concurrent.futures import ThreadPoolExecutor

    closed: list[str] = []

    async def main():
        with ThreadPoolExecutor(2, thread_name_prefix="pump") as pool:
            every = [item async for item in threaded_stream(pool, lambda: _blocking_items([]))]
            stream = threaded_stream(pool, lambda: _blocking_items(closed))
            first = await anext(stream)
            await stream.aclose()
            await asyncio.sleep(0.1)  # the pump thread sees the stop at its next item
            return every, first

    every, first = asyncio.run(main())
    assert every == ["a", "b", "c", "d"] and first == "a"
    assert len(closed) == 1 and closed[0].startswith("pump")  # closed on its own thread


def test_threaded_stream_raises_the_iterators_error():
    from concurrent.futures import ThreadPoolExecutor

    def failing():
        yield "a"
        raise ValueError("the prompt is over the context")

    async def main():
        with ThreadPoolExecutor(1) as pool:
            return [item async for item in threaded_stream(pool, failing)]

    with pytest.raises(ValueError, match="over the context"):
        asyncio.run(main())


class _Blocking(ThreadedAsync):
    """An engine whose calls block, as the HTTP engines' do."""

    def generate(self, messages, tools=None, sampling=None, adapter="policy"):
        time.sleep(0.01)
        return threading.current_thread().name

    def stream(self, messages, tools=None, sampling=None, adapter="policy"):
        yield threading.current_thread().name


def test_blocking_engines_run_off_the_loop_and_concurrently():
    engine = _Blocking()

    async def main():
        started = time.perf_counter()
        names = await asyncio.gather(*(engine.agenerate(MESSAGES) for _ in range(20)))
        streamed = [item async for item in engine.astream(MESSAGES)]
        return names, streamed, time.perf_counter() - started

    names, streamed, _ = asyncio.run(main())
    engine._close_threads()
    loop_thread = threading.current_thread().name
    assert all(n.startswith("engine-call") for n in names + streamed)
    assert loop_thread not in names
    assert len(set(names)) > 1  # more than one thread: calls do not queue behind each other


def test_embedded_agenerate_and_astream_match_the_blocking_calls(tiny_engine):
    sampling = SamplingParams(temperature=1.0, max_tokens=12, seed=5)

    async def main():
        completion = await tiny_engine.agenerate(MESSAGES, sampling=sampling)
        items = [item async for item in tiny_engine.astream(MESSAGES, sampling=sampling)]
        return completion, items

    completion, (*chunks, final) = asyncio.run(main())
    blocking = tiny_engine.generate(MESSAGES, sampling=sampling)
    # a repeat reuses the first call's KV (the prefix cache): its log-probs agree to rounding
    for one in (completion, blocking):
        assert dataclasses.replace(one, completion_logprobs=final.completion_logprobs) == final
        assert one.completion_logprobs == pytest.approx(final.completion_logprobs, abs=1e-5)
    assert tuple(i for c in chunks for i in c.token_ids) == final.completion_token_ids
    assert "".join(c.text for c in chunks) == tiny_engine.tokenizer.decode(
        final.completion_token_ids
    )


def test_embedded_astream_refuses_bad_input_at_the_call_and_frees_a_left_stream(tiny_engine):
    scheduler = tiny_engine._scheduler
    long = [{"role": "user", "content": "word " * (tiny_engine.context_length + 10)}]

    async def main():
        with pytest.raises(ValueError, match="context"):
            tiny_engine.astream(long)  # before any iteration, like `stream`
        stream = tiny_engine.astream(MESSAGES, sampling=SamplingParams(max_tokens=200))
        await anext(stream)
        await stream.aclose()
        for _ in range(200):  # the scheduler drops the cancelled row at its next step
            if scheduler._batch is None and not scheduler._waiting:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())
