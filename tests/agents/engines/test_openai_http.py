"""Response parsing shared by the vLLM and remote engines, on response bodies in the shapes
vLLM 0.32 returns (recorded from the real server; no server is needed for these)."""

import httpx
import pytest

from agents.engines.base import Completion, ContextExceeded, SamplingParams, TokenChunk
from agents.engines.openai_http import (
    BadRequestError,
    _error_of,
    chat_body,
    completion_from_chat,
    stream_completion,
)

TOOLS = [{"type": "function", "function": {"name": "calculator"}}]
CALL_TEXT = (
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>'
)


def _logprobs(*tokens):
    return {
        "content": [
            {"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []}
            for t in tokens
        ]
    }


def test_tool_calls_are_parsed_from_the_text_and_markup_stays_in_the_raw_text():
    response = {
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {
                "message": {"role": "assistant", "content": CALL_TEXT},
                "token_ids": [7, 8, 2],
                "logprobs": _logprobs(CALL_TEXT[:20], CALL_TEXT[20:], "<|im_end|>"),
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3},
    }
    completion = completion_from_chat(response, policy_version=4, tools=TOOLS)
    call = completion.message["tool_calls"][0]["function"]
    assert call == {"name": "calculator", "arguments": '{"expression": "2 + 2"}'}
    assert completion.message["content"] is None
    assert completion.finish_reason == "tool_calls"
    assert completion.text == CALL_TEXT + "<|im_end|>"
    assert completion.completion_logprobs == (-0.5, -0.5, -0.5)
    assert (completion.prompt_token_ids, completion.completion_token_ids) == ((1, 2, 3), (7, 8, 2))
    assert completion.policy_version == 4


def test_a_stream_is_reassembled_into_the_same_completion():
    events = [
        {"choices": [{"delta": {"role": "assistant", "content": ""}}], "prompt_token_ids": [1, 2]},
        {
            "choices": [
                {"delta": {"content": "Hel"}, "token_ids": [5], "logprobs": _logprobs("Hel")}
            ]
        },
        {
            "choices": [
                {
                    "delta": {"content": "lo"},
                    "token_ids": [6],
                    "logprobs": _logprobs("lo"),
                    "finish_reason": "length",
                }
            ]
        },
        {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}},
    ]
    *chunks, final = stream_completion(iter(events), policy_version=1, tools=TOOLS)
    assert chunks == [TokenChunk((5,), (-0.5,), "Hel"), TokenChunk((6,), (-0.5,), "lo")]
    assert isinstance(final, Completion)
    assert final.message == {"role": "assistant", "content": "Hello"}
    assert (final.prompt_token_ids, final.completion_token_ids) == ((1, 2), (5, 6))
    assert final.finish_reason == "length" and final.text == "Hello"


def test_structured_tool_calls_of_other_servers_are_kept_and_ids_left_empty():
    events = [
        {
            "choices": [
                {
                    "delta": {
                        "tool_calls": [
                            {"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a"'}}
                        ]
                    }
                }
            ]
        },
        {
            "choices": [
                {
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                    "finish_reason": "tool_calls",
                }
            ]
        },
    ]
    *_, final = stream_completion(iter(events), policy_version=0, tools=TOOLS)
    assert final.message["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]
    assert final.finish_reason == "tool_calls"
    assert final.completion_token_ids == () and final.completion_logprobs == ()


@pytest.mark.parametrize("token_ids", [True, False])
def test_vllm_extensions_are_only_asked_for_on_request(token_ids):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    sampling = SamplingParams(temperature=0.0, max_tokens=5, stop=("x",), seed=3)
    body = chat_body(
        "m",
        [{"role": "user", "content": "hi"}],
        tools,
        sampling,
        token_ids=token_ids,
        logprobs=True,
    )
    assert body["stop"] == ["x"] and body["seed"] == 3 and body["logprobs"] is True
    assert ("return_token_ids" in body) is token_ids
    assert body.get("tool_choice") == ("none" if token_ids else None)


def test_without_tools_call_markup_is_plain_content():
    response = {
        "prompt_token_ids": [1],
        "choices": [
            {"message": {"role": "assistant", "content": CALL_TEXT}, "finish_reason": "stop"}
        ],
    }
    completion = completion_from_chat(response, policy_version=0, tools=None)
    assert completion.message == {"role": "assistant", "content": CALL_TEXT.strip()}
    assert completion.finish_reason == "stop"


VLLM_CONTEXT = (
    "This model's maximum context length is 4096 tokens. However, your request has 9010 "
    "input tokens. Please reduce the length of the input messages."
)


@pytest.mark.parametrize(
    "status, body, context",
    [
        (400, {"object": "error", "message": VLLM_CONTEXT, "type": "BadRequestError"}, True),
        (
            400,
            {"error": {"message": "the prompt has 9000 tokens", "code": "context_length_exceeded"}},
            True,
        ),
        (400, {"error": {"message": "temperature must be in [0, 2]", "code": None}}, False),
        (404, {"error": {"message": "The model `x` does not exist.", "code": 404}}, False),
    ],
)
def test_a_prompt_past_the_context_is_told_apart_from_other_bad_requests(status, body, context):
    """What an episode acts on (it elides old outputs for one, and fails on the others)."""
    error = _error_of(httpx.Response(status, json=body))
    assert isinstance(error, BadRequestError)
    assert isinstance(error, ContextExceeded) is context


def test_a_server_error_is_never_a_context_refusal():
    error = _error_of(httpx.Response(500, json={"error": {"message": VLLM_CONTEXT}}))
    assert not isinstance(error, BadRequestError | ContextExceeded)


def _top_entry(token_id, logprob, tops):
    """One position as vLLM 0.32 sends it with `return_tokens_as_token_ids`: the sampled
    token first in its top list when it ranks below what was asked."""
    return {
        "token": f"token_id:{token_id}",
        "logprob": logprob,
        "bytes": [104],
        "top_logprobs": [{"token": f"token_id:{i}", "logprob": lp, "bytes": []} for i, lp in tops],
    }


def test_top_k_is_asked_for_as_k_plus_one_ids_and_read_back_sorted():
    sampling = SamplingParams(top_logprobs=2)
    body = chat_body(
        "m", [{"role": "user", "content": "hi"}], None, sampling, token_ids=True, logprobs=True
    )
    assert body["top_logprobs"] == 3 and body["return_tokens_as_token_ids"] is True
    plain = chat_body(
        "m",
        [{"role": "user", "content": "hi"}],
        None,
        SamplingParams(),
        token_ids=True,
        logprobs=True,
    )
    assert "top_logprobs" not in plain and "return_tokens_as_token_ids" not in plain
    response = {
        "prompt_token_ids": [1],
        "choices": [
            {
                "message": {"role": "assistant", "content": "hh"},
                "token_ids": [9, 4],
                "logprobs": {
                    "content": [
                        # sampled 9 ranks fourth: listed first, then the top 2
                        _top_entry(9, -3.0, [(9, -3.0), (4, -0.5), (7, -1.0)]),
                        # sampled 4 ranks first: the top 3, no extra
                        _top_entry(4, -0.1, [(4, -0.1), (2, -2.5), (8, -2.9)]),
                    ]
                },
                "finish_reason": "length",
            }
        ],
    }
    completion = completion_from_chat(response, 0, None, top_k=2)
    assert completion.top_ids == ((4, 7), (4, 2))
    assert completion.top_logprobs == ((-0.5, -1.0), (-0.1, -2.5))
    assert completion.text == "hh"  # the raw text still comes from each token's bytes
    assert completion_from_chat(response, 0, None).top_ids == ()
    events = [{"choices": [dict(response["choices"][0], delta={"content": "hh"})]}]
    *chunks, final = stream_completion(iter(events), 0, None, top_k=2)
    assert chunks[0].top_ids == final.top_ids == ((4, 7), (4, 2))
