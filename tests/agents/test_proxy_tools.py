"""Tool calls through the proxy, plain and streamed.

The random-weight `tiny` model never writes a tool call, so `ScriptedEngine` stands in for
the model's *sampling only*: it "samples" the token ids of a fixed reply (encoded by the
real tokenizer) with their log-probs from the real model, and builds the `Completion` with
the embedded engine's own code (template, tool-call parser). Everything from the engine
interface up (proxy, serialisation, streaming, store) is the real thing.
"""

from __future__ import annotations

import json

import pytest

from agents.engines.aio import ThreadedAsync
from agents.engines.base import POLICY, Completion, SamplingParams, TokenChunk
from agents.engines.embedded import EmbeddedEngine
from tests.agents.serving import served_client

REPLY = (
    "Let me compute. <tool_call>\n"
    '{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>'
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluates arithmetic.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
USER = [{"role": "user", "content": "What is 2 + 2?"}]


class ScriptedEngine(ThreadedAsync):
    """The embedded engine with its sampling replaced by a fixed reply (see module doc)."""

    def __init__(self, engine, reply):
        self.engine, self.reply = engine, reply

    @property
    def policy_version(self):
        return self.engine.policy_version

    def encode(self, messages, tools=None):
        return self.engine.encode(messages, tools)

    def generate(self, messages, tools=None, sampling=None, adapter=POLICY):
        *_, completion = self.stream(messages, tools, sampling, adapter)
        return completion

    def stream(self, messages, tools=None, sampling=None, adapter=POLICY):
        prompt = self.engine.encode(messages, tools)
        tokenizer = self.engine.tokenizer
        ids = tokenizer.encode(self.reply, add_special_tokens=False)
        ids.append(min(self.engine._eos_ids()))
        logprobs = self.engine.score(prompt, ids, adapter)
        return self._events(prompt, ids, logprobs, sampling or SamplingParams(), tools)

    def _events(self, prompt, ids, logprobs, sampling, tools):
        shown = ""
        for end in range(1, len(ids) + 1):
            text = self.engine.tokenizer.decode(ids[:end])
            yield TokenChunk((ids[end - 1],), (logprobs[end - 1],), text[len(shown) :])
            shown = text
        yield self.engine._completion(prompt, ids, logprobs, sampling, self.policy_version, tools)

    def score(self, prompt_ids, completion_ids, adapter=None, images=()):
        return self.engine.score(prompt_ids, completion_ids, adapter)

    def load_adapter(self, path, version):
        self.engine.load_adapter(path, version)

    def prepare_adapter(self, path):
        self.engine.prepare_adapter(path)

    def close(self):
        self._close_threads()


@pytest.fixture(scope="module")
def tiny_engine():
    """`tiny` on one thread: for a 4M-parameter model more threads only add overhead."""
    engine = EmbeddedEngine("tiny", threads=1)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def served(tiny_engine, tmp_path_factory):
    engine = ScriptedEngine(tiny_engine, REPLY)
    with served_client(engine, tmp_path_factory.mktemp("tools")) as client_and_store:
        yield client_and_store


def test_tool_calls_come_back_in_openai_format_and_are_stored(served):
    client, store = served
    raw = client.chat.completions.with_raw_response.create(
        model="policy", messages=USER, tools=TOOLS, extra_headers={"X-Session-Id": "tools"}
    )
    choice = raw.parse().choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me compute."
    assert call.type == "function" and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "2 + 2"}
    (turn,) = store.session("tools").turns
    assert turn.completion["tool_calls"][0]["id"] == call.id
    assert turn.tools == tuple(TOOLS)

    result = {"role": "tool", "tool_call_id": call.id, "content": "4"}
    history = [*USER, choice.message.model_dump(exclude_none=True), result]
    client.chat.completions.create(
        model="policy", messages=history, tools=TOOLS, extra_headers={"X-Session-Id": "tools"}
    )
    first = store.session("tools").turns[0]
    assert first.next_state == (result,)


def test_streamed_tool_calls_leak_no_markup(served):
    client, _ = served
    chunks = list(
        client.chat.completions.create(model="policy", messages=USER, tools=TOOLS, stream=True)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert content == "Let me compute." and "<" not in content
    assert len([d for d in deltas if d.content]) > 1  # streamed, not sent at the end
    assert [c.function.name for c in calls] == ["calculator"]
    assert json.loads(calls[0].function.arguments) == {"expression": "2 + 2"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_scripted_completion_is_what_the_parser_makes_of_the_text(tiny_engine):
    completion = ScriptedEngine(tiny_engine, REPLY).generate(USER, TOOLS)
    assert isinstance(completion, Completion) and completion.finish_reason == "tool_calls"
    assert tiny_engine.tokenizer.decode(completion.completion_token_ids[:-1]) == REPLY
