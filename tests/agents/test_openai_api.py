"""What the proxy streams as content while a completion is sampled."""

from __future__ import annotations

from agents.openai_api import ContentStream
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
