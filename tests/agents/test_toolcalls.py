from agents.toolcalls import assistant_message, parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "f"}}]


def test_plain_text_is_content():
    assert parse_tool_calls("Paris.") == {"role": "assistant", "content": "Paris."}


def test_calls_are_parsed_and_text_kept():
    text = (
        "Let me compute.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>\n'
        '<tool_call>{"name": "submit", "arguments": "{\\"answer\\": 4}"}</tool_call>'
    )
    message = parse_tool_calls(text)
    assert message["content"] == "Let me compute."
    assert message["tool_calls"] == [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'},
        },
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "submit", "arguments": '{"answer": 4}'},
        },
    ]


def test_unterminated_call_at_the_end_still_parses():
    message = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {}}')
    assert message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}


def test_broken_json_stays_in_the_content():
    text = "<tool_call>{name: f}</tool_call>"
    assert parse_tool_calls(text) == {"role": "assistant", "content": text}


def test_calls_are_parsed_only_for_a_request_with_tools():
    text = ' Calling. <tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
    assert assistant_message(text, TOOLS)["tool_calls"][0]["function"]["name"] == "f"
    for tools in (None, []):
        assert assistant_message(text, tools) == {"role": "assistant", "content": text.strip()}
