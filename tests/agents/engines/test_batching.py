"""Continuous batching in the embedded engine: concurrent requests share forward passes and
still get what each would get alone; adapter swaps never break a running request; prompts
that reuse earlier requests' KV get exactly what a cold prefill gives."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from agents.engines.base import BASE, POLICY, Completion, SamplingParams
from agents.engines.batch import END, common_length, prefill_passes
from agents.engines.embedded import EmbeddedEngine
from agents.engines.sampling import pick_tokens, sampling_weights
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
    assert not any(engine._scheduler.adapters.users.values())


def test_an_abandoned_stream_is_cancelled_and_others_continue(engine):
    stream = engine.stream(PROMPTS[0], sampling=SamplingParams(max_tokens=2000))
    next(stream)
    stream.close()
    result = engine.generate(PROMPTS[1], sampling=GREEDY)
    assert len(result.completion_token_ids) > 0
    # the scheduler hands a request its last token before it frees the row
    deadline = time.monotonic() + 1  # well under the 2,000 tokens the abandoned one asked for
    while engine._scheduler._batch is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine._scheduler._batch is None


def test_a_prompt_over_the_context_is_refused_before_queueing(engine):
    huge = [{"role": "user", "content": "word " * (engine.context_length + 10)}]
    with pytest.raises(ValueError, match="context"):
        engine.stream(huge)


# -- sampling ---------------------------------------------------------------------------
PROBS = [0.2, 0.5, 0.3]
LOGPROBS = torch.tensor(PROBS).log()


@pytest.mark.parametrize(
    "temperature, top_p, expected",
    [
        (1.0, 1.0, PROBS),
        (0.5, 1.0, [0.04 / 0.38, 0.25 / 0.38, 0.09 / 0.38]),  # p**2, normalized
        (1.0, 0.6, [0.0, 0.5, 0.3]),  # 0.5 falls short of 0.6: the next token joins
        (1.0, 0.4, [0.0, 0.5, 0.0]),
        (1.0, 1e-46, [0.0, 0.5, 0.0]),  # 0 in float32: the likeliest token stays
        (1.0, 5e-324, [0.0, 0.5, 0.0]),
        (1e-30, 1.0, [0.0, 1.0, 0.0]),  # scaled log-probs still finite: all on the likeliest
        (1e-38, 1e-46, [0.0, 1.0, 0.0]),  # a float32 subnormal: log(0.2) / 1e-38 is finite
    ],
)
def test_sampling_weights_on_hand_computed_values(temperature, top_p, expected):
    weights = sampling_weights(LOGPROBS, temperature, top_p)
    assert weights is not None
    assert weights.tolist() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 1e-40, 5e-324])
def test_temperatures_too_small_to_divide_by_are_greedy(temperature):
    assert sampling_weights(LOGPROBS, temperature, 1.0) is None
    assert pick_tokens(LOGPROBS[None], [SamplingParams(temperature=temperature)], [None]) == [1]


def test_a_certain_token_at_a_temperature_that_is_zero_in_float32_is_greedy():
    """log(1) / 0 is NaN, not -inf."""
    logprobs = torch.tensor([1.0, 0.0]).log()
    assert sampling_weights(logprobs, 5e-324, 1.0) is None
    assert pick_tokens(logprobs[None], [SamplingParams(temperature=5e-324)], [None]) == [0]


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-38, 1e-30, 1e-10, 1e-3, 1.0, 10.0])
@pytest.mark.parametrize("top_p", [5e-324, 1e-46, 1e-7, 0.5, 1.0])
def test_every_legal_sampling_value_draws_a_token(temperature, top_p):
    logprobs = torch.randn(50_000, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    sampling = SamplingParams(temperature=temperature, top_p=top_p)
    [token] = pick_tokens(logprobs[None], [sampling], [torch.Generator().manual_seed(1)])
    assert token is not None and 0 <= token < 50_000
    if temperature <= 1e-30 or top_p <= 1e-7:  # only the likeliest token is left
        assert token == int(logprobs.argmax())


def test_rows_drawn_together_follow_their_weights_and_their_own_seeds():
    """Rows of one temperature share a draw; each row's token depends on its seed alone, and
    the drawn frequencies match the weights (4,000 draws: within 0.03 of each, about four
    standard errors)."""
    logprobs = torch.stack([LOGPROBS, LOGPROBS.flip(0)])
    sampling = SamplingParams(temperature=1.0)

    def seeded(seed):
        return torch.Generator().manual_seed(seed)

    alone = pick_tokens(logprobs[:1], [sampling], [seeded(3)])
    beside = pick_tokens(logprobs, [sampling, sampling], [seeded(3), seeded(4)])
    assert beside[0] == alone[0]
    generator = seeded(0)
    counts = torch.zeros(2, 3)
    for _ in range(2000):
        for row, token in enumerate(pick_tokens(logprobs, [sampling] * 2, [generator] * 2)):
            counts[row, token] += 1
    assert (counts / 2000).tolist()[0] == pytest.approx(PROBS, abs=0.03)
    assert (counts / 2000).tolist()[1] == pytest.approx(PROBS[::-1], abs=0.03)


def test_greedy_rows_and_a_broken_distribution_beside_sampled_rows():
    logprobs = torch.stack([LOGPROBS, LOGPROBS, torch.full((3,), float("nan"))])
    samplings = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.4), SamplingParams()]
    assert pick_tokens(logprobs, samplings, [None] * 3) == [1, 1, None]


def queued_together(engine, submit):
    """Runs `submit` on the scheduler thread, so that all it queues joins one prefill."""
    return engine._scheduler.call(submit)


def test_extreme_sampling_values_are_served_beside_normal_requests(engine):
    extremes = [SamplingParams(temperature=t, max_tokens=12) for t in (1e-40, 5e-324, 1e-38)]
    extremes += [SamplingParams(temperature=1.0, top_p=p, max_tokens=12) for p in (1e-46, 5e-324)]
    greedy = [engine.generate(p, sampling=GREEDY) for p in PROMPTS[: len(extremes)]]
    normal = [SamplingParams(temperature=1.0, max_tokens=12, seed=n) for n in range(3)]
    jobs = list(zip(PROMPTS, extremes + normal, strict=False))
    streams = queued_together(engine, lambda: [engine.stream(p, sampling=s) for p, s in jobs])
    results = [list(stream)[-1] for stream in streams]
    for one, extreme in zip(greedy, results, strict=False):  # all but greedy
        assert extreme.completion_token_ids == one.completion_token_ids
        assert extreme.completion_logprobs == pytest.approx(one.completion_logprobs, abs=1e-4)
    assert all(len(r.completion_token_ids) > 0 for r in results[len(extremes) :])


def test_a_request_that_fails_while_sampling_fails_alone(engine):
    alone = [engine.generate(p, sampling=GREEDY) for p in PROMPTS[:3]]
    events: queue.SimpleQueue = queue.SimpleQueue()

    def broken(ids):
        raise RuntimeError("a broken stop check")

    def submit():
        streams = [engine.stream(p, sampling=GREEDY) for p in PROMPTS[:3]]
        prompt = engine.encode(PROMPTS[3])
        engine._scheduler.submit(prompt, GREEDY, 12, broken, use_policy=False, events=events)
        return streams

    streams = queued_together(engine, submit)
    assert isinstance(events.get(timeout=60), tuple)  # its first token, then its error
    assert "broken stop check" in str(events.get(timeout=60))
    results = [list(stream)[-1] for stream in streams]
    assert [r.completion_token_ids for r in results] == [r.completion_token_ids for r in alone]


def test_a_prompt_that_breaks_the_prefill_fails_alone_and_running_rows_go_on(engine, tmp_path):
    """A policy adapter makes the failed prefill a mixed batch: the pass peft leaves its
    per-row hooks behind in when it raises."""
    version = engine.policy_version + 1
    engine.load_adapter(str(save_random_adapter(tmp_path / "v", seed=7)), version)
    long = SamplingParams(temperature=0.0, max_tokens=200)
    running_alone = engine.generate(PROMPTS[0], sampling=long)
    alone = [engine.generate(p, sampling=GREEDY) for p in PROMPTS[1:4]]
    events: queue.SimpleQueue = queue.SimpleQueue()
    running = engine.stream(PROMPTS[0], sampling=long)
    next(running)

    def submit():
        streams = [engine.stream(p, sampling=GREEDY) for p in PROMPTS[1:4]]
        beyond_vocabulary = [engine.model.config.vocab_size + 5]
        engine._scheduler.submit(beyond_vocabulary, GREEDY, 4, None, False, events)
        batch = engine._scheduler._batch
        return streams, len(batch.rows) if batch else 0

    streams, rows_running = queued_together(engine, submit)
    assert rows_running == 1
    assert isinstance(events.get(timeout=60), IndexError)
    results = [list(stream)[-1] for stream in streams]
    assert [r.completion_token_ids for r in results] == [r.completion_token_ids for r in alone]
    assert list(running)[-1].completion_token_ids == running_alone.completion_token_ids


# -- prefix reuse ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def warm():
    """An engine with the default prefix cache, for these tests alone (its contents and
    adapter versions are theirs)."""
    engine = EmbeddedEngine("tiny", threads=1)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def cold():
    """The same model without a prefix cache: every prompt prefilled whole, alone."""
    engine = EmbeddedEngine("tiny", threads=1, prefix_cache_tokens=0)
    yield engine
    engine.close()


@dataclass(frozen=True)
class Ran:
    cached: int
    """Prompt tokens the prefix cache gave."""
    tokens: list[int]
    logprobs: list[float]


def submit(engine, prompt, policy=False):
    """Queues prompt token ids, greedy, on the policy or the base model."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    request = engine._scheduler.submit(prompt, GREEDY, GREEDY.max_tokens, None, policy, events)
    return request, events


def collect(submitted) -> Ran:
    request, events = submitted
    tokens, logprobs = [], []
    while (item := events.get(timeout=60)) is not END:
        if isinstance(item, BaseException):
            raise item
        tokens.append(item[0])
        logprobs.append(item[1])
    return Ran(request.cached, tokens, logprobs)


def run(engine, prompt, policy=False) -> Ran:
    return collect(submit(engine, prompt, policy))


def assert_cold(ran: Ran, cold, prompt, policy=False) -> None:
    """`ran` is what the engine without a prefix cache gives the prompt alone."""
    alone = run(cold, prompt, policy)
    assert alone.cached == 0
    assert ran.tokens == alone.tokens
    assert ran.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def conversation(tag, question):
    """A system prompt of its own per test (`tag` first), then a question."""
    system = f"{tag}: you are a careful calculator. Answer with one number and nothing else."
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def publish(tmp_path, seed, *engines):
    """One random adapter, served by every engine as the same new version."""
    path = str(save_random_adapter(tmp_path / f"seed{seed}", seed=seed))
    version = max(engine.policy_version for engine in engines) + 1
    for engine in engines:
        engine.load_adapter(path, version)


def test_prompts_sharing_a_system_prompt_reuse_its_kv_exactly(warm, cold):
    prompts = [warm.encode(conversation("shared", f"what is {n} + {n}?")) for n in range(4)]
    shortest = min(len(prompt) for prompt in prompts)
    shared = next(i for i in range(shortest) if len({prompt[i] for prompt in prompts}) > 1)
    ran = [run(warm, prompt) for prompt in prompts]
    assert ran[0].cached < shared  # only the template's first tokens, from other tests
    assert [r.cached for r in ran[1:]] == [shared] * 3
    for prompt, one in zip(prompts, ran, strict=True):
        assert_cold(one, cold, prompt)


def test_prompts_arriving_together_prefill_their_common_prefix_once_exactly(warm, cold):
    prompts = [warm.encode(conversation("together", f"what is {n} * 7?")) for n in range(3)]
    common = common_length(prompts)
    submitted = queued_together(warm, lambda: [submit(warm, prompt) for prompt in prompts])
    ran = [collect(one) for one in submitted]
    # one prefill of the common prefix went to the prefix cache; each row read it from there
    assert [one.cached for one in ran] == [common] * 3
    for prompt, one in zip(prompts, ran, strict=True):
        assert_cold(one, cold, prompt)


def test_a_second_turn_reuses_the_first_turn_whole(warm, cold):
    first_prompt = warm.encode(conversation("turns", "what is 2 + 3?"))
    first = run(warm, first_prompt)
    follow_up = warm.encode([{"role": "user", "content": "and times 4?"}])
    second_prompt = first_prompt + first.tokens + follow_up
    second = run(warm, second_prompt)
    # every token the first turn fed back: all but its last sampled one
    assert second.cached == len(first_prompt) + len(first.tokens) - 1
    assert_cold(first, cold, first_prompt)
    assert_cold(second, cold, second_prompt)


def test_rows_with_different_cached_lengths_share_one_prefill_exactly(warm, cold):
    first_prompt = warm.encode(conversation("rows", "what is 7 + 1?"))
    first = run(warm, first_prompt)
    prompts = [
        warm.tokenizer("no template: a prompt whose first token nothing shares")["input_ids"],
        warm.encode(conversation("rows", "what is 9 + 9?")),
        first_prompt + first.tokens + warm.encode([{"role": "user", "content": "why?"}]),
        first_prompt,
    ]
    submitted = queued_together(warm, lambda: [submit(warm, prompt) for prompt in prompts])
    ran = [collect(one) for one in submitted]
    cached = [one.cached for one in ran]
    assert cached[0] == 0
    assert cached[3] == len(first_prompt) - 1  # the prompt's last token is computed
    assert len(set(cached)) == 4
    for prompt, one in zip(prompts, ran, strict=True):
        assert_cold(one, cold, prompt)


def test_base_and_policy_rows_reuse_only_their_own_kv(warm, cold, tmp_path):
    publish(tmp_path, 21, warm, cold)
    prompts = [warm.encode(conversation("mixed", q)) for q in ("what is 1 + 4?", "is 5 odd?")]
    run(warm, prompts[0])  # base KV only
    jobs = [(prompts[1], False), (prompts[1], True), (prompts[0], True)]
    submitted = queued_together(warm, lambda: [submit(warm, p, policy) for p, policy in jobs])
    ran = [collect(one) for one in submitted]
    assert ran[0].cached > 0
    # base KV is not the policy's: the two policy rows read only the prefix they share,
    # prefilled once with the policy's weights as they arrived (exact: `assert_cold` below)
    assert ran[1].cached == ran[2].cached == common_length(prompts)
    again = run(warm, prompts[1], policy=True)
    assert again.cached == len(prompts[1]) - 1  # the policy's own, from the row above
    assert ran[0].logprobs != pytest.approx(ran[1].logprobs, abs=1e-3)
    for (prompt, policy), one in zip([*jobs, (prompts[1], True)], [*ran, again], strict=True):
        assert_cold(one, cold, prompt, policy)


def test_a_new_policy_version_never_reuses_an_older_ones_kv(warm, cold, tmp_path):
    prompt = warm.encode(conversation("versions", "what is 3 + 3?"))
    publish(tmp_path, 31, warm, cold)
    first_slot = warm._scheduler.adapters.policy[0]
    assert run(warm, prompt, policy=True).cached == 0
    assert run(warm, prompt, policy=True).cached == len(prompt) - 1
    for seed in (32, 33, 34):
        publish(tmp_path, seed, warm, cold)
        after = run(warm, prompt, policy=True)
        assert after.cached == 0
        assert_cold(after, cold, prompt, policy=True)
        if warm._scheduler.adapters.policy[0] == first_slot:
            break
    assert warm._scheduler.adapters.policy[0] == first_slot, "the first version's slot was refilled"


def test_a_prefix_cache_over_its_bound_evicts_and_stays_exact(cold):
    """Six 52-token prompts and their completions, in a cache of 96 tokens."""
    small = EmbeddedEngine("tiny", threads=1, prefix_cache_tokens=96)
    try:
        prompts = [small.encode(conversation("bound", f"what is {n} * 3?")) for n in range(6)]
        for prompt in prompts:
            one = run(small, prompt)
            assert small._scheduler.prefixes.tokens <= 96
            assert_cold(one, cold, prompt)
        # the newest sequence is held whole, the oldest's end was evicted
        assert run(small, prompts[-1]).cached == len(prompts[-1]) - 1
        assert run(small, prompts[0]).cached < len(prompts[0]) - 1
    finally:
        small.close()


@pytest.mark.parametrize(
    ("widths", "passes"),
    [
        ([], []),
        ([30, 30, 30], [[0, 1, 2]]),
        # one pass: 32 + 2 x 40 = 112 columns; two: 32 + 30 + 32 + 40 = 134
        ([30, 40], [[0, 1]]),
        # one pass: 32 + 4 x 300 = 1232; the long row alone: 32 + 3 x 30 + 32 + 300 = 454
        ([300, 30, 30, 30], [[1, 2, 3], [0]]),
        ([10, 200, 12, 210], [[0, 2], [1, 3]]),
    ],
)
def test_prefill_passes_on_hand_computed_costs(widths, passes):
    assert prefill_passes(widths, pass_tokens=32) == passes


def test_rows_of_very_different_widths_are_prefilled_in_passes_exactly(warm, cold):
    """Three next turns (all but a few tokens cached) arrive with a long prompt nothing
    of which is cached: the long one is prefilled alone, not as wide as the others."""
    firsts = [warm.encode(conversation("passes", f"what is {n} - 1?")) for n in range(3)]
    follow_up = warm.encode([{"role": "user", "content": "and plus 2?"}])
    seconds = [prompt + run(warm, prompt).tokens + follow_up for prompt in firsts]
    long = warm.tokenizer("a long prompt of its own, nothing cached: " + "seven " * 120)
    prompts = [*seconds, long["input_ids"]]
    before = warm._scheduler.computed_tokens
    submitted = queued_together(warm, lambda: [submit(warm, prompt) for prompt in prompts])
    ran = [collect(one) for one in submitted]
    widths = [len(prompt) - one.cached for prompt, one in zip(prompts, ran, strict=True)]
    assert widths[3] == len(prompts[3]) and max(widths[:3]) < 32
    computed = warm._scheduler.computed_tokens - before
    assert computed == 3 * max(widths[:3]) + widths[3]  # two passes, each as wide as its widest
    assert computed < 4 * widths[3]  # what one pass would have computed
    for prompt, one in zip(prompts, ran, strict=True):
        assert_cold(one, cold, prompt)
