"""Session identity from headers / body fields, and next-state linking, on plain data."""

from __future__ import annotations

import pytest

from agents.sessions import identify, is_transient, next_state
from agents.trajectory import TurnType

MAIN = TurnType.MAIN
Q = {"role": "user", "content": "q"}
A = {"role": "assistant", "content": "a"}
TRANSIENT = {"role": "user", "content": "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nx"}


def test_headers_win_and_body_fields_are_popped():
    body = {"session_id": "body", "turn_type": "main", "session_done": True, "model": "policy"}
    info = identify({"x-session-id": "head", "x-turn-type": "side"}, body, MAIN)
    assert (info.session_id, info.turn_type, info.done) == ("head", TurnType.SIDE, True)
    assert body == {"model": "policy"}


def test_openclaw_affinity_headers_name_the_session():
    assert identify({"session_id": "abc:0"}, {}, MAIN).session_id == "abc"
    assert identify({"x-session-affinity": "a:b:0"}, {}, MAIN).session_id == "a:b"
    assert identify({"x-session-affinity": "plain"}, {}, MAIN).session_id == "plain"


def test_defaults_are_a_fresh_id_and_the_configured_type():
    first, second = identify({}, {}, MAIN), identify({}, {}, TurnType.SIDE)
    assert first.session_id != second.session_id and len(first.session_id) == 32
    assert (first.turn_type, second.turn_type, first.done) == (MAIN, TurnType.SIDE, False)


def test_a_bad_turn_type_is_refused():
    with pytest.raises(ValueError, match="main"):
        identify({"x-turn-type": "both"}, {}, MAIN)


def test_transient_context_is_recognised_in_text_and_parts():
    parts = {"role": "user", "content": [{"type": "text", "text": TRANSIENT["content"]}]}
    assert is_transient(TRANSIENT) and is_transient(parts)
    assert not is_transient(Q) and not is_transient({**TRANSIENT, "role": "system"})


def test_next_state_is_what_follows_the_previous_reply():
    tool = {"role": "tool", "tool_call_id": "c", "content": "4"}
    reply = {"role": "user", "content": "thanks"}
    assert next_state([Q, A, tool, reply], 1, [A]) == (0, [tool, reply])


def test_next_state_finds_the_reply_when_history_was_rewritten():
    compacted = [{"role": "system", "content": "summary"}, A, {"role": "user", "content": "r"}]
    assert next_state(compacted, 5, [A]) == (0, [compacted[2]])


def test_next_state_picks_the_choice_the_client_kept():
    other = {"role": "assistant", "content": "b"}
    reply = {"role": "user", "content": "r"}
    assert next_state([Q, other, reply], 1, [A, other]) == (1, [reply])


def test_no_next_state_when_nothing_was_added():
    assert next_state([Q], 1, [A]) is None
    assert next_state([Q, A], 1, [A]) is None
