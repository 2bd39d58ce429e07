"""Tool calls in model text, in the convention of `chat_template.jinja` (Hermes / Qwen):

    some text
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 2"}}
    </tool_call>

`parse_tool_calls` turns such text into an OpenAI assistant message. A block that is not
valid JSON stays in the content, so the environment sees exactly what the model wrote.
Engines build their messages with `assistant_message`, which parses calls only for a
request that offered tools.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def assistant_message(text: str, tools: Sequence[Any] | None) -> dict[str, Any]:
    """The assistant message of a completion's text, with tool calls only when the request
    offered `tools`: OpenAI's API returns none to a request without tools (or with
    `tool_choice: "none"`, for which the proxy offers none), so there any markup the model
    wrote is plain content."""
    if tools:
        return parse_tool_calls(text)
    return {"role": "assistant", "content": text.strip()}


def parse_tool_calls(text: str, id_prefix: str = "call") -> dict[str, Any]:
    """The assistant message for a completion's text: content plus any tool calls."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        call = _decode(match.group(1))
        if call is None:
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        name, arguments = call
        calls.append(
            {
                "id": f"{id_prefix}_{len(calls)}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    kept.append(text[position:])
    content = "".join(kept).strip()
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content if content or not calls else None,
    }
    if calls:
        message["tool_calls"] = calls
    return message


def _decode(block: str) -> tuple[str, str] | None:
    try:
        payload = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = payload.get("arguments", payload.get("parameters", {}))
    return payload["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)
