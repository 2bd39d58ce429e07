"""Request validation end to end: the official `openai` client against a real proxy server
(`tests.agents.serving.running`: uvicorn on a loopback port, in a thread of this process)
on the `tiny` model. A body OpenAI's API refuses is a 400 naming its param, commits
nothing, and the server serves on; `tool_choice: "none"` gets a reply without tool calls
whatever the model writes (the scripted engine of `tests.agents.test_proxy_tools`: `tiny`
never writes a call).
"""

from __future__ import annotations

import openai
import pytest

from tests.agents.serving import served_client
from tests.agents.test_proxy_tools import REPLY, TOOLS, USER, ScriptedEngine

AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
REMOTE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
SEARCH = {"type": "function", "function": {"name": "search"}}


@pytest.fixture(scope="module")
def served(tiny_engine, tmp_path_factory):
    with served_client(tiny_engine, tmp_path_factory.mktemp("validation")) as client_and_store:
        yield client_and_store


@pytest.fixture(scope="module")
def scripted(tiny_engine, tmp_path_factory):
    """The proxy over an engine whose model always writes `REPLY`, a tool call."""
    engine = ScriptedEngine(tiny_engine, REPLY)
    with served_client(engine, tmp_path_factory.mktemp("validation-tools")) as client_and_store:
        yield client_and_store


BAD = {
    "tool_choice bogus": ({"tools": TOOLS, "tool_choice": "bogus"}, "tool_choice"),
    "tool_choice without tools": ({"tool_choice": "required"}, "tool_choice"),
    "tool_choice not in tools": ({"tools": TOOLS, "tool_choice": SEARCH}, "tool_choice"),
    "duplicate tools": ({"tools": TOOLS * 2}, "tools"),
    "empty tools": ({"tools": []}, "tools"),
    "temperature a string": ({"temperature": "0.5"}, "temperature"),
    "seed over int64": ({"seed": 2**63}, "seed"),
    "stream a string": ({"extra_body": {"stream": "yes"}}, "stream"),
    "tool result without id": (
        {"messages": [*USER, {"role": "tool", "content": "4"}]},
        "messages[1].tool_call_id",
    ),
    "an audio part": (
        {"messages": [{"role": "user", "content": [AUDIO]}]},
        "messages[0].content[0].type",
    ),
    "an image by URL": (
        {"messages": [{"role": "user", "content": [REMOTE]}]},
        "messages[0].content[0].image_url.url",
    ),
    "empty content": ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    "json output": ({"response_format": {"type": "json_object"}}, "response_format"),
    "a penalty": ({"frequency_penalty": 0.5}, "frequency_penalty"),
    "top_logprobs without logprobs": ({"top_logprobs": 3}, "top_logprobs"),
    "top_logprobs over 20": ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "a logit bias": ({"logit_bias": {"1": 5}}, "logit_bias"),
    "audio out": ({"modalities": ["text", "audio"]}, "modalities"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_a_400_naming_its_param_and_serving_goes_on(served, case):
    client, store = served
    change, param = BAD[case]
    turns = store.count_turns()
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            **{"model": "policy", "messages": USER, "max_tokens": 2, **change}
        )
    error = raised.value
    assert error.param == param and error.type == "invalid_request_error"
    assert error.body["message"].startswith(f"{param}: ")
    assert store.count_turns() == turns
    reply = client.chat.completions.create(model="policy", messages=USER, max_tokens=2)
    assert reply.choices[0].message.role == "assistant" and store.count_turns() == turns + 1


def test_a_bad_stream_request_is_refused_before_the_stream_starts(served):
    client, _ = served
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="policy", messages=USER, stream=True, tool_choice="auto", max_tokens=2
        )
    assert raised.value.param == "tool_choice"


def test_defaults_of_unsupported_fields_and_vendor_fields_are_accepted(served):
    client, store = served
    reply = client.chat.completions.create(
        model="policy",
        messages=USER,
        max_tokens=2,
        temperature=1,
        frequency_penalty=0,
        presence_penalty=0,
        logit_bias={},
        response_format={"type": "text"},
        logprobs=True,
        top_logprobs=0,
        modalities=["text"],
        tool_choice="none",
        extra_body={"session_id": "vendor", "store": False, "metadata": {"run": "x"}},
    )
    assert reply.choices[0].message.role == "assistant"
    assert len(store.session("vendor").turns) == 1


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": TOOLS[0]["function"]}]
)
def test_required_and_named_choices_are_accepted_not_enforced(served, choice):
    client, _ = served
    reply = client.chat.completions.create(
        model="policy", messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=2
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "offer", [{"tools": TOOLS, "tool_choice": "none"}, {}], ids=["none", "no tools"]
)
def test_without_tools_on_offer_the_reply_has_no_tool_calls(scripted, offer):
    client, store = scripted
    raw = client.chat.completions.with_raw_response.create(model="policy", messages=USER, **offer)
    choice = raw.parse().choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content == REPLY.strip()
    (turn,) = store.session(raw.headers["x-session-id"]).turns
    assert "tool_calls" not in turn.completion
    chunks = list(
        client.chat.completions.create(model="policy", messages=USER, stream=True, **offer)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not [d for d in deltas if d.tool_calls]
    assert "".join(d.content or "" for d in deltas) == REPLY.strip()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
