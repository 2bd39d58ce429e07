"""Session identity from headers / body fields, and next-state linking: on plain data, and
through `SessionTracker` on a real store."""

from __future__ import annotations

import pytest

from agents.engines.base import Completion
from agents.serving.histories import is_transient, next_state
from agents.serving.identity import SessionEnded, SessionInfo, SessionRefused, identify
from agents.serving.sessions import SessionTracker
from agents.store import Store
from agents.trajectory import SessionStatus, TurnType

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
    with pytest.raises(SessionRefused, match="main") as refused:
        identify({"x-turn-type": "both"}, {}, MAIN)
    assert refused.value.param == "X-Turn-Type"


@pytest.mark.parametrize(
    "session_id", ["caf\u00e9", "a\r\nX-Injected: yes", "x" * 257, {"id": 1}, True, "tab\there"]
)
def test_a_session_id_that_cannot_go_back_in_a_header_is_refused(session_id):
    with pytest.raises(SessionRefused, match="session id") as refused:
        identify({}, {"session_id": session_id}, MAIN)
    assert refused.value.param == "X-Session-Id"


def test_printable_ids_and_numbers_are_session_ids():
    assert identify({}, {"session_id": 42}, MAIN).session_id == "42"
    assert identify({"x-session-id": "agent:main main"}, {}, MAIN).session_id == "agent:main main"
    assert identify({}, {"session_id": "x" * 256}, MAIN).named
    assert not identify({}, {}, MAIN).named


def test_transient_context_is_recognised_in_text_and_parts():
    parts = {"role": "user", "content": [{"type": "text", "text": TRANSIENT["content"]}]}
    assert is_transient(TRANSIENT) and is_transient(parts)
    assert not is_transient(Q) and not is_transient({**TRANSIENT, "role": "system"})


def test_next_state_is_what_follows_the_previous_reply():
    tool = {"role": "tool", "tool_call_id": "c", "content": "4"}
    reply = {"role": "user", "content": "thanks"}
    assert next_state([Q, A, tool, reply], 1, A) == [tool, reply]


def test_next_state_finds_the_reply_when_history_was_compacted():
    compacted = [{"role": "system", "content": "summary"}, A, {"role": "user", "content": "r"}]
    assert next_state(compacted, 5, A) == [compacted[2]]


def test_next_state_matches_reshaped_replies_and_tool_calls():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    ours = {"role": "assistant", "content": " ok ", "tool_calls": [call]}
    echoed = {
        "role": "assistant",
        "content": [{"type": "text", "text": "ok"}],
        "tool_calls": [{**call, "id": "other", "function": {"name": "f", "arguments": '{"x":1}'}}],
    }
    tool = {"role": "tool", "tool_call_id": "other", "content": "2"}
    assert next_state([Q, echoed, tool], 1, ours) == [tool]


def test_no_next_state_from_a_history_without_the_reply():
    edited = {"role": "assistant", "content": "something the policy never said"}
    assert next_state([Q, edited, {"role": "user", "content": "r"}], 1, A) is None
    assert next_state([{"role": "user", "content": "a title please"}], 1, A) is None
    assert next_state([Q, A], 1, A) is None  # nothing added after it


# -- the tracker on a real store ---------------------------------------------------------


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "store.sqlite") as opened:
        yield opened


def completion(text):
    return Completion(
        message={"role": "assistant", "content": text},
        prompt_token_ids=(1, 2),
        completion_token_ids=(3,),
        completion_logprobs=(-0.5,),
        finish_reason="stop",
        policy_version=0,
    )


def serve(tracker, info, messages, *texts):
    """One request through the tracker as the proxy makes it: begin, then commit."""
    info = tracker.begin(info, messages)
    completions = [completion(t) for t in texts]
    tracker.commit(info, messages, completions, [dict(c.message) for c in completions])
    return info


def said(text):
    return {"role": "assistant", "content": text}


def user(text):
    return {"role": "user", "content": text}


def session_turns(store, session_id):
    return [t.next_state for t in store.session(session_id).turns]


def test_each_turn_gets_what_followed_it(store):
    tracker, info = SessionTracker(store), SessionInfo("s", MAIN, False)
    serve(tracker, info, [Q], "a1")
    serve(tracker, info, [Q, said("a1"), user("r1"), TRANSIENT], "a2")
    serve(tracker, info, [Q, said("a1"), user("r1"), said("a2"), user("r2")], "a3")
    assert session_turns(store, "s") == [(user("r1"),), (user("r2"),), None]


def test_an_auxiliary_main_call_takes_no_next_state(store):
    tracker, info = SessionTracker(store), SessionInfo("s", MAIN, False)
    serve(tracker, info, [Q], "a1")
    serve(tracker, info, [user("Give a 3-word title for this chat")], "Math Question Help")
    serve(tracker, info, [Q, said("a1"), user("real follow-up")], "a2")
    assert session_turns(store, "s") == [(user("real follow-up"),), None, None]


def test_an_edited_reply_is_not_linked(store):
    tracker, info = SessionTracker(store), SessionInfo("s", MAIN, False)
    serve(tracker, info, [Q], "a1")
    serve(tracker, info, [Q, said("EDITED"), user("next")], "a2")
    assert session_turns(store, "s") == [None, None]


def test_the_kept_choice_is_linked_and_its_siblings_end_empty(store):
    tracker, info = SessionTracker(store), SessionInfo("s", MAIN, False)
    serve(tracker, info, [Q], "a", "b", "c")
    serve(tracker, info, [Q, said("b"), user("r")], "d")
    assert session_turns(store, "s") == [(), (user("r"),), (), None]


def test_a_retry_of_the_same_prompt_ends_empty_once_the_other_is_continued(store):
    tracker, info = SessionTracker(store), SessionInfo("s", MAIN, False)
    serve(tracker, info, [Q], "first try")
    serve(tracker, info, [Q], "second try")
    serve(tracker, info, [Q, said("second try"), user("r")], "a3")
    assert session_turns(store, "s") == [(), (user("r"),), None]


def test_a_client_without_session_ids_continues_its_conversation(store):
    tracker = SessionTracker(store)
    first = serve(tracker, identify({}, {}, MAIN), [Q], "a1")
    other = serve(tracker, identify({}, {}, MAIN), [Q], "a1 elsewhere")
    again = serve(tracker, identify({}, {}, MAIN), [Q, said("a1"), user("r")], "a2")
    fresh = serve(tracker, identify({}, {}, MAIN), [user("a new chat")], "a3")
    assert again.session_id == first.session_id and not again.named
    assert len({first.session_id, other.session_id, fresh.session_id}) == 3
    assert session_turns(store, first.session_id) == [(user("r"),), None]
    assert session_turns(store, other.session_id) == [None]


def test_a_closed_session_refuses_later_requests(store):
    tracker = SessionTracker(store)
    serve(tracker, SessionInfo("s", MAIN, True), [Q], "a1")
    assert store.session("s").status is SessionStatus.DONE
    with pytest.raises(SessionEnded, match="use a new id"):
        tracker.begin(SessionInfo("s", MAIN, False), [Q, said("a1"), user("r")])
    with pytest.raises(SessionEnded):  # a restarted proxy knows too
        SessionTracker(store).begin(SessionInfo("s", TurnType.SIDE, False), [Q])


def test_idle_sessions_end_their_open_turns_and_leave_memory(store):
    tracker = SessionTracker(store)
    serve(tracker, SessionInfo("idle", MAIN, False), [Q], "a", "b")
    serve(tracker, SessionInfo("busy", MAIN, False), [Q], "c")
    assert tracker.expire_idle(3600) == 0
    tracker._states["idle"].seen -= 3600
    assert tracker.expire_idle(3600) == 2
    assert session_turns(store, "idle") == [(), ()] and set(tracker._states) == {"busy"}
    # the user comes back later: the session goes on at the next index, nothing to link
    serve(tracker, SessionInfo("idle", MAIN, False), [Q, said("a"), user("r")], "d")
    assert session_turns(store, "idle") == [(), (), None]


def test_a_restarted_tracker_links_the_open_turn_from_the_store(store):
    serve(SessionTracker(store), SessionInfo("s", MAIN, False), [Q, TRANSIENT], "a1")
    serve(SessionTracker(store), SessionInfo("s", MAIN, False), [Q, said("a1"), user("r")], "a2")
    assert session_turns(store, "s") == [(user("r"),), None]
    assert [t.index for t in store.session("s").turns] == [0, 1]


def test_a_session_keeps_at_most_its_newest_open_turns(store, monkeypatch):
    monkeypatch.setattr("agents.serving.sessions.MAX_OPEN_ENDS", 3)
    tracker, info = SessionTracker(store), SessionInfo("s", MAIN, False)
    for number in range(5):
        serve(tracker, info, [user(f"unrelated {number}")], f"a{number}")
    assert len(tracker._states["s"].open_ends) == 3
    assert tracker.expire_idle(3600) == 2  # the two dropped, the session is not idle
    assert session_turns(store, "s") == [(), (), None, None, None]
    serve(tracker, info, [user("unrelated 4"), said("a4"), user("r")], "a5")
    assert session_turns(store, "s")[4] == (user("r"),)
