"""Whether a new history continues a previous reply, and what it adds after it: the
matching behind next states (`agents.serving.sessions.SessionTracker`).

A history continues a reply when it holds an assistant message saying the same (content
and tool calls; clients re-shape them) where the reply is expected, or elsewhere (a client
that compacted its history); what comes after it is the reply's next state. OpenClaw's
transient internal-context message, which every request carries and no history keeps, is
left out of both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

INTERNAL_CONTEXT = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"
SEARCHED_ENDS = 8
"""Open ends whose reply is looked for anywhere in a new history, not only where expected."""


def is_transient(message: Mapping[str, Any]) -> bool:
    """OpenClaw's per-request internal-context message, which no history keeps."""
    return message.get("role") == "user" and _text(message.get("content")).lstrip().startswith(
        INTERNAL_CONTEXT
    )


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)


def _same_reply(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two assistant messages say the same (clients may re-shape them)."""
    return (
        a.get("role") == "assistant"
        and _text(a.get("content")).strip() == _text(b.get("content")).strip()
        and _calls(a) == _calls(b)
    )


def _calls(message: Mapping[str, Any]) -> list[tuple[str, Any]]:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        arguments = function.get("arguments")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass
        calls.append((function.get("name"), arguments))
    return calls


def next_state(
    messages: Sequence[Mapping[str, Any]], prompt_length: int, reply: Mapping[str, Any]
) -> list[Mapping[str, Any]] | None:
    """What a new history adds after a previous reply; None when it does not continue it.

    Args:
        messages: the new request's messages, transient ones removed.
        prompt_length: how many (non-transient) messages the reply's request had: where the
            reply is expected in the new history. Elsewhere is accepted too (a client that
            compacted its history), the last place it is found.
        reply: the previous turn's reply.
    """
    expected = prompt_length < len(messages) and _same_reply(messages[prompt_length], reply)
    if expected:
        position = prompt_length
    else:
        found = [i for i, m in enumerate(messages) if _same_reply(m, reply)]
        if not found:
            return None
        position = found[-1]
    added = list(messages[position + 1 :])
    return added or None


def continued(
    ends: Sequence[OpenEnd], kept: Sequence[Mapping[str, Any]]
) -> tuple[OpenEnd, list[Mapping[str, Any]]] | None:
    """The newest open end a history continues, with what it adds after that end's reply.

    First where each reply is expected (a look at one message an end), then anywhere in
    the history for the newest `SEARCHED_ENDS` (a compacted history): a request costs
    O(ends + messages), and nothing for one with no assistant message at all.
    """
    if not any(m.get("role") == "assistant" for m in kept):
        return None
    for end in reversed(ends):
        at = len(end.prompt)
        if at + 1 < len(kept) and _same_reply(kept[at], end.reply):
            return end, list(kept[at + 1 :])
    for end in ends[: -SEARCHED_ENDS - 1 : -1]:
        if (added := next_state(kept, len(end.prompt), end.reply)) is not None:
            return end, added
    return None


def conversation_key(messages: Sequence[Mapping[str, Any]]) -> int:
    """A fingerprint of a conversation's text (role, content, tool calls of each message),
    the same for the re-shapings `_same_reply` accepts."""
    return hash(
        tuple(
            (
                str(m.get("role")),
                _text(m.get("content")).strip(),
                json.dumps(_calls(m), sort_keys=True, default=str),
                str(m.get("tool_call_id") or ""),
            )
            for m in messages
        )
    )


@dataclass(frozen=True)
class OpenEnd:
    """A main turn still waiting for what the conversation says after it."""

    index: int
    prompt: tuple[Mapping[str, Any], ...]
    """Its request's messages, transient ones removed."""
    reply: Mapping[str, Any]
    key: int | None = None
    """`conversation_key` of prompt + reply, for a session whose id the proxy minted."""
