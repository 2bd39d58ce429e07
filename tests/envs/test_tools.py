from typing import Literal

import pytest

from envs.tools import Tool, ToolCallError


def search(
    query: str, limit: int = 5, kinds: list[str] | None = None, order: Literal["new", "top"] = "top"
) -> str:
    """Searches the index.

    Args:
        query: words to look for.
        limit: most results
            to return.
        kinds: document kinds.
        order: sort order.
    """
    return f"{query}:{limit}:{kinds}:{order}"


def test_schema_from_typed_function_matches_hand_written_schema():
    tool = Tool.from_function(search)
    assert tool.schema == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Searches the index.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "words to look for."},
                    "limit": {"type": "integer", "description": "most results to return."},
                    "kinds": {
                        "type": "array",
                        "items": {"type": "string"},
                        "description": "document kinds.",
                    },
                    "order": {
                        "type": "string",
                        "enum": ["new", "top"],
                        "description": "sort order.",
                    },
                },
                "required": ["query"],
            },
        },
    }


def test_bind_accepts_json_string_and_mapping():
    tool = Tool.from_function(search)
    assert tool.bind('{"query": "cats", "limit": 2}') == {"query": "cats", "limit": 2}
    assert tool.bind({"query": "cats", "kinds": ["a"]}) == {"query": "cats", "kinds": ["a"]}


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        ('{"query": "x"', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ("{}", "missing required argument query"),
        ('{"query": "x", "colour": 1}', "has no argument colour"),
        ('{"query": 3}', "should be a JSON string"),
        ('{"query": "x", "limit": 2.5}', "should be a JSON integer"),
        ('{"query": "x", "limit": true}', "should be a JSON integer"),
        ('{"query": "x", "order": "old"}', 'one of "new", "top"'),
    ],
)
def test_bind_rejects_bad_calls_with_a_readable_reason(arguments, fragment):
    with pytest.raises(ToolCallError, match=fragment):
        Tool.from_function(search).bind(arguments)


def test_untyped_argument_is_refused_at_declaration():
    def bad(x):  # type: ignore[no-untyped-def]
        """Bad."""

    with pytest.raises(TypeError, match="needs a type"):
        Tool.from_function(bad)
