"""The chat-completions wire format: what the proxy streams as content while a completion
is sampled, and which request bodies it takes (each rule, accepted and refused cases)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from agents.serving.chat_request import ChatRequest, validation_message
from agents.serving.openai_api import ContentStream
from agents.toolcalls import parse_tool_calls

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>'


def streamed(text, pieces, stops=()):
    """Feeds `text` in pieces of the given size, then the parsed final content."""
    stream = ContentStream(stops)
    sent = [stream.feed(text[i : i + pieces]) for i in range(0, len(text), pieces)]
    final = parse_tool_calls(text[: min([text.find(s) for s in stops if s in text] or [len(text)])])
    return "".join(sent), "".join(sent) + stream.finish(final["content"]), final


def test_tool_call_markup_never_reaches_streamed_content():
    for size in (1, 2, 5):
        live, whole, final = streamed("Let me compute. " + CALL, size)
        assert "<" not in live and live == "Let me compute."
        assert whole == final["content"] == "Let me compute."
        assert final["tool_calls"][0]["function"]["name"] == "calculator"


def test_plain_text_streams_whole_and_stops_are_held_back():
    live, whole, final = streamed("  Hello there, friend.  ", 1)
    assert live == whole == final["content"] == "Hello there, friend."
    live, whole, _ = streamed("one two END three", 1, stops=("END",))
    assert live == whole == "one two"


def test_an_unparsable_call_is_sent_as_content_at_the_end():
    live, whole, final = streamed("x <tool_call>{broken", 1)
    assert live == "x" and whole == final["content"] == "x <tool_call>{broken"


# -- request validation --------------------------------------------------------------------

USER = [{"role": "user", "content": "What is 2 + 2?"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
NAMED = {"type": "function", "function": {"name": "calculator"}}
CALLED = {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}


def request(**change: Any) -> ChatRequest:
    """`change` over a minimal body, parsed from JSON as the proxy parses it."""
    return ChatRequest.model_validate_json(
        json.dumps({"model": "policy", "messages": USER, **change})
    )


def refusal(**change: Any) -> tuple[str, str | None]:
    """What the proxy would answer the body: its message and `param`."""
    with pytest.raises(ValidationError) as raised:
        request(**change)
    return validation_message(raised.value.errors())


def functions(*names: str, parameters: Any = None) -> list[dict[str, Any]]:
    schema = {} if parameters is None else {"parameters": parameters}
    return [{"type": "function", "function": {"name": n, **schema}} for n in names]


def user(content: Any, **fields: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content, **fields}]


ACCEPTED = {
    "tool_choice auto": {"tools": [TOOL], "tool_choice": "auto"},
    "tool_choice required": {"tools": [TOOL], "tool_choice": "required"},
    "tool_choice named": {"tools": [TOOL], "tool_choice": NAMED},
    "tool_choice none without tools": {"tool_choice": "none"},
    "tool_choice none with tools": {"tools": [TOOL], "tool_choice": "none"},
    "parameters without type": {"tools": functions("f", parameters={"properties": {}})},
    "an int temperature": {"temperature": 1, "top_p": 1},
    "int64 seed bounds": {"seed": -(2**63), "n": 2},
    "text parts": {"messages": user([{"type": "text", "text": "hi", "cache_control": {}}])},
    "assistant with calls and no content": {
        "messages": [
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [CALLED]},
            {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "4"}]},
        ],
        "tools": [TOOL],
    },
    "unsupported fields at their defaults": {
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "logit_bias": {},
        "response_format": {"type": "text"},
        "logprobs": True,
        "top_logprobs": 0,
        "modalities": ["text"],
        "audio": None,
    },
    "vendor and session fields": {"session_id": "s", "store": False, "skip_special_tokens": 0},
}


@pytest.mark.parametrize("case", ACCEPTED)
def test_valid_requests_are_accepted(case):
    assert request(**ACCEPTED[case]).model == "policy"


REFUSED = {
    # tool_choice: its four forms only, and only with tools
    "tool_choice bogus": ({"tools": [TOOL], "tool_choice": "bogus"}, "tool_choice", "must be"),
    "tool_choice a number": ({"tools": [TOOL], "tool_choice": 5}, "tool_choice", "must be"),
    "tool_choice a list": ({"tools": [TOOL], "tool_choice": []}, "tool_choice", "must be"),
    "tool_choice bad type": (
        {"tools": [TOOL], "tool_choice": {"type": "bogus"}},
        "tool_choice",
        "must be",
    ),
    "tool_choice unknown function": (
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "search"}}},
        "tool_choice",
        "'search' is not in tools",
    ),
    "tool_choice auto without tools": ({"tool_choice": "auto"}, "tool_choice", "only allowed"),
    "tool_choice required without tools": (
        {"tool_choice": "required"},
        "tool_choice",
        "only allowed",
    ),
    "tool_choice named without tools": ({"tool_choice": NAMED}, "tool_choice", "only allowed"),
    # tools
    "empty tools": ({"tools": []}, "tools", "empty array"),
    "duplicate names": ({"tools": functions("f", "g", "f")}, "tools", "'f' is given twice"),
    "parameters a list": (
        {"tools": functions("f", parameters=[1])},
        "tools[0].function.parameters",
        "object",
    ),
    "parameters of an array": (
        {"tools": functions("f", parameters={"type": "array"})},
        "tools[0].function.parameters.type",
        "'object'",
    ),
    "properties a list": (
        {"tools": functions("f", parameters={"type": "object", "properties": ["x"]})},
        "tools[0].function.parameters.properties",
        "object",
    ),
    # strict types
    "temperature a string": ({"temperature": "0.5"}, "temperature", "got a string"),
    "temperature a boolean": ({"temperature": True}, "temperature", "got a boolean"),
    "top_p a string": ({"top_p": "0.5"}, "top_p", "got a string"),
    "max_tokens a string": ({"max_tokens": "5"}, "max_tokens", "got a string"),
    "max_tokens a decimal": ({"max_tokens": 5.0}, "max_tokens", "got a number"),
    "max_completion_tokens a boolean": (
        {"max_completion_tokens": True},
        "max_completion_tokens",
        "got a boolean",
    ),
    "n a string": ({"n": "2"}, "n", "got a string"),
    "seed a string": ({"seed": "7"}, "seed", "got a string"),
    "seed over int64": ({"seed": 2**63}, "seed", "less than or equal"),
    "seed under int64": ({"seed": -(2**63) - 1}, "seed", "greater than or equal"),
    "stream yes": ({"stream": "yes"}, "stream", "got a string"),
    "logprobs 1": ({"logprobs": 1}, "logprobs", "got an integer"),
    "return_token_ids a string": ({"return_token_ids": "true"}, "return_token_ids", "boolean"),
    "top_logprobs a string": (
        {"logprobs": True, "top_logprobs": "1"},
        "top_logprobs",
        "got a string",
    ),
    # messages
    "tool message without tool_call_id": (
        {"messages": [*USER, {"role": "tool", "content": "4"}]},
        "messages[1].tool_call_id",
        "required",
    ),
    "tool_calls on a user message": (
        {"messages": user("hi", tool_calls=[CALLED])},
        "messages[0].tool_calls",
        "only assistant messages",
    ),
    "an image of no known type": (
        {"messages": user([{"type": "image_url", "image_url": {"url": "data:,"}}])},
        "messages[0].content[0].image_url.url",
        "send image/png or image/jpeg",
    ),
    "an image by URL": (
        {"messages": user([{"type": "image_url", "image_url": {"url": "https://x/y.png"}}])},
        "messages[0].content[0].image_url.url",
        "inline as a data URL",
    ),
    "an audio part after text": (
        {"messages": user([{"type": "text", "text": "hi"}, {"type": "input_audio"}])},
        "messages[0].content[1].type",
        "takes text and images",
    ),
    "an unknown part": (
        {"messages": user([{"type": "bogus"}])},
        "messages[0].content[0].type",
        "not supported by this server",
    ),
    "a text part without text": (
        {"messages": user([{"type": "text"}])},
        "messages[0].content[0]",
        'needs "text"',
    ),
    "an image part without its image": (
        {"messages": user([{"type": "image_url"}])},
        "messages[0].content[0]",
        'needs "image_url"',
    ),
    "empty user content": ({"messages": user([])}, "messages[0].content", "at least 1 item"),
    "empty system content": (
        {"messages": [{"role": "system", "content": []}, *USER]},
        "messages[0].content",
        "at least 1 item",
    ),
    "empty tool content": (
        {"messages": [*USER, {"role": "tool", "tool_call_id": "c", "content": []}]},
        "messages[1].content",
        "at least 1 item",
    ),
    "user content a number": ({"messages": user(5)}, "messages[0].content", "got an integer"),
    "an unknown role": (
        {"messages": [{"role": "wizard", "content": "hi"}]},
        "messages[0].role",
        "'wizard'",
    ),
    # what this server does not do
    "response_format json": (
        {"response_format": {"type": "json_object"}},
        "response_format",
        "not supported by this server",
    ),
    "response_format unknown": (
        {"response_format": {"type": "yaml"}},
        "response_format.type",
        "'text'",
    ),
    "a logit bias": (
        {"logit_bias": {"50256": -100}},
        "logit_bias",
        "not supported by this server",
    ),
    "a frequency penalty": (
        {"frequency_penalty": 0.5},
        "frequency_penalty",
        "not supported by this server",
    ),
    "a presence penalty": (
        {"presence_penalty": -1},
        "presence_penalty",
        "not supported by this server",
    ),
    "a penalty out of range": ({"presence_penalty": 2.5}, "presence_penalty", "less than"),
    "top_logprobs above 20": ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    "top_logprobs without logprobs": ({"top_logprobs": 0}, "top_logprobs", "logprobs: true"),
    "audio out": ({"modalities": ["text", "audio"]}, "modalities", "not supported"),
    "audio parameters": ({"audio": {"voice": "alloy"}}, "audio", "not supported"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_invalid_requests_are_refused_naming_the_param(case):
    change, param, says = REFUSED[case]
    message, refused = refusal(**change)
    assert refused == param and message.startswith(f"{param}: ")
    assert says in message


def test_tools_are_shown_unless_tool_choice_is_none():
    assert request(tools=[TOOL]).tool_schemas() == [TOOL]
    assert request(tools=[TOOL], tool_choice="none").tool_schemas() is None
    assert request().tool_schemas() is None


def test_messages_reach_the_engine_as_sent():
    history = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [CALLED]},
        {"role": "tool", "tool_call_id": "c", "content": "4"},
    ]
    messages = [m.for_engine() for m in request(messages=history).messages]
    assert messages[0] == {"role": "system", "content": history[0]["content"]}
    assert messages[1:] == [
        USER[0],
        {"role": "assistant", "tool_calls": [CALLED]},
        history[3],
    ]
