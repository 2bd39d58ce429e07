"""The vLLM sampler's request and answer, on hand-made values (its runs against a real vLLM
server are tests/agents/engines/test_tinker_vllm.py)."""

import math

import pytest

from trainers.tinker.samplers import completion_body, parse_completion
from trainers.tinker.sampling import SamplingParams


def test_completion_body_samples_as_tinker_does():
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, stop_tokens=(2,))
    body = completion_body("tinker-x-1", [5, 6], 3, params, prompt_logprobs=True)
    assert body["prompt"] == [5, 6] and body["n"] == 3 and body["max_tokens"] == 7
    assert (body["temperature"], body["top_p"], body["top_k"]) == (0.5, 0.9, -1)
    # only what the client named stops a sequence, and every sampled id comes back
    assert body["stop_token_ids"] == [2] and body["ignore_eos"] is True
    assert body["return_tokens_as_token_ids"] and body["logprobs"] == 0
    assert body["prompt_logprobs"] == 0 and "seed" not in body and "stop" not in body
    seeded = completion_body("m", [5], 1, SamplingParams(max_tokens=1, seed=4, top_k=8), False)
    assert (seeded["seed"], seeded["top_k"]) == (4, 8) and "prompt_logprobs" not in seeded


def test_parse_completion_reads_ids_logprobs_and_the_prompts_scores():
    response = {
        "choices": [
            {
                "index": 1,
                "finish_reason": "length",
                "logprobs": {"tokens": ["token_id:9"], "token_logprobs": [-0.5]},
            },
            {
                "index": 0,
                "finish_reason": "stop",
                "logprobs": {"tokens": ["token_id:7", "token_id:2"], "token_logprobs": [-1, -2]},
                "prompt_logprobs": [None, {"6": {"logprob": -3.0}, "8": {"logprob": -0.1}}],
            },
        ]
    }
    sequences, scored = parse_completion(response, [5, 6], 2, prompt_logprobs=True)
    assert [(s.tokens, s.logprobs, s.stopped) for s in sequences] == [
        ((7, 2), (-1.0, -2.0), True),
        ((9,), (-0.5,), False),
    ]
    assert math.isnan(scored[0]) and scored[1:] == [-3.0]


def test_parse_completion_refuses_a_short_or_untokenised_answer():
    one = {"choices": [{"logprobs": {"tokens": ["hello"], "token_logprobs": [-1.0]}}]}
    with pytest.raises(RuntimeError, match="not a token id"):
        parse_completion(one, [5], 1, prompt_logprobs=False)
    with pytest.raises(RuntimeError, match="returned 1 choices for 2"):
        parse_completion(one, [5], 2, prompt_logprobs=False)
