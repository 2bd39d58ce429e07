"""Continuous batching in the embedded engine: concurrent requests share forward passes and
still get what each would get alone; adapter swaps never break a running request."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from agents.engines.base import BASE, POLICY, Completion, SamplingParams
from agents.engines.embedded import EmbeddedEngine
from tests.agents.engines.conftest import save_random_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = [[{"role": "user", "content": "word " * n}] for n in range(1, 11)]


@pytest.fixture(scope="module")
def engine():
    """A private engine: these tests load adapters, which the shared one must not see (one
    thread: for a 4M-parameter model more only add overhead)."""
    engine = EmbeddedEngine("tiny", threads=1)
    yield engine
    engine.close()


def concurrently(function, items):
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(function, items))


def test_concurrent_requests_match_sequential_ones(engine):
    alone = [engine.generate(p, sampling=GREEDY) for p in PROMPTS]
    together = concurrently(lambda p: engine.generate(p, sampling=GREEDY), PROMPTS)
    for one, batched in zip(alone, together, strict=True):
        assert batched.prompt_token_ids == one.prompt_token_ids
        assert batched.completion_token_ids == one.completion_token_ids
        assert batched.completion_logprobs == pytest.approx(one.completion_logprobs, abs=1e-4)


def test_requests_really_share_forward_passes(engine, monkeypatch):
    """Counts the model's forward calls: ten 12-token requests take far fewer than 120."""
    calls = []
    scheduler = engine._scheduler
    original = scheduler._forward

    def counting(rows, *args):
        calls.append(len(rows))
        return original(rows, *args)

    monkeypatch.setattr(scheduler, "_forward", counting)
    barrier = threading.Barrier(len(PROMPTS))

    def request(prompt):
        barrier.wait()
        return engine.generate(prompt, sampling=SamplingParams(temperature=1.0, max_tokens=12))

    results = concurrently(request, PROMPTS)
    generated = sum(len(r.completion_token_ids) for r in results)
    assert len(calls) < generated / 2
    assert max(calls) > 1


def test_base_and_policy_rows_share_a_batch(engine, tmp_path):
    engine.load_adapter(str(save_random_adapter(tmp_path / "v1", seed=1)), version=1)
    jobs = [(p, adapter) for p in PROMPTS[:4] for adapter in (POLICY, BASE)]
    alone = [engine.generate(p, sampling=GREEDY, adapter=a) for p, a in jobs]
    mixed = concurrently(lambda job: engine.generate(job[0], sampling=GREEDY, adapter=job[1]), jobs)
    for (_, adapter), one, batched in zip(jobs, alone, mixed, strict=True):
        assert batched.policy_version == (1 if adapter == POLICY else 0)
        assert batched.completion_token_ids == one.completion_token_ids
    assert alone[0].completion_logprobs != pytest.approx(alone[1].completion_logprobs, abs=1e-3)


def test_a_swap_mid_request_keeps_each_request_on_its_version(engine, tmp_path):
    version = engine.policy_version
    long = SamplingParams(temperature=0.0, max_tokens=40)
    started = threading.Event()

    def request(prompt):
        stream = engine.stream(prompt, sampling=long)
        next(stream)
        started.set()
        *_, final = stream
        return final

    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(request, p) for p in PROMPTS[:4]]
        started.wait(timeout=60)
        engine.load_adapter(str(save_random_adapter(tmp_path / "next", seed=5)), version + 1)
        after = engine.generate(PROMPTS[0], sampling=GREEDY)
        results = [f.result(timeout=120) for f in running]
    assert all(isinstance(r, Completion) and r.policy_version == version for r in results)
    assert after.policy_version == version + 1 == engine.policy_version
    engine.score(after.prompt_token_ids, after.completion_token_ids)  # one more scheduler round
    # Every finished request (and the score) gave its slot back: the next publish has one.
    assert not any(engine._scheduler._users.values())


def test_an_abandoned_stream_is_cancelled_and_others_continue(engine):
    stream = engine.stream(PROMPTS[0], sampling=SamplingParams(max_tokens=2000))
    next(stream)
    stream.close()
    result = engine.generate(PROMPTS[1], sampling=GREEDY)
    assert len(result.completion_token_ids) > 0
    assert engine._scheduler._batch is None


def test_a_prompt_over_the_context_is_refused_before_queueing(engine):
    huge = [{"role": "user", "content": "word " * (engine.context_length + 10)}]
    with pytest.raises(ValueError, match="context"):
        engine.stream(huge)
