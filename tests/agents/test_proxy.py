"""The proxy over the real embedded engine on `tiny`, through the official `openai` client
against a real uvicorn server on a loopback port: completions, streaming, sessions,
headers (OpenClaw's included), the API key, and every kind of bad input."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time

import httpx
import openai
import pytest

from agents.engines.embedded import EmbeddedEngine
from agents.serving.proxy import ProxyConfig
from agents.store import Store
from agents.trajectory import SessionStatus, TurnType
from tests.agents.serving import running, served_client

USER = [{"role": "user", "content": "What is 2 + 2?"}]
SHORT = {"max_tokens": 6, "temperature": 1.0}
TRANSIENT = {
    "role": "user",
    "content": "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nnow: Monday\n"
    "<<<END_OPENCLAW_INTERNAL_CONTEXT>>>",
}


@pytest.fixture(scope="module")
def tiny_engine():
    """`tiny` on one thread: for a 4M-parameter model more threads only add overhead."""
    engine = EmbeddedEngine("tiny", threads=1)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def served(tiny_engine, tmp_path_factory):
    """(base URL, store, proxy)."""
    store = Store(tmp_path_factory.mktemp("proxy") / "store.sqlite")
    with running(tiny_engine, store) as (url, proxy):
        yield url, store, proxy
    store.close()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0], api_key="none", max_retries=0)


@pytest.fixture
def store(served):
    return served[1]


def create(client, messages=USER, headers=None, **kwargs):
    """A completion with its raw response (for headers)."""
    raw = client.chat.completions.with_raw_response.create(
        model="policy", messages=messages, extra_headers=headers or {}, **{**SHORT, **kwargs}
    )
    return raw.parse(), raw.headers


def test_completion_is_committed_token_exactly_before_it_returns(client, store, tiny_engine):
    reply, headers = create(client, seed=3)
    session = store.session(headers["x-session-id"])
    (turn,) = session.turns
    assert turn.turn_type is TurnType.MAIN and turn.policy_version == 0
    assert list(turn.prompt_token_ids) == tiny_engine.encode(USER)
    assert reply.usage.completion_tokens == len(turn.completion_token_ids) > 0
    assert reply.choices[0].message.content == turn.completion["content"]
    rescored = tiny_engine.score(turn.prompt_token_ids, turn.completion_token_ids)
    assert rescored == pytest.approx(list(turn.completion_logprobs), abs=1e-4)


def test_token_ids_and_logprobs_on_request(client, store):
    reply, headers = create(client, logprobs=True, extra_body={"return_token_ids": True})
    (turn,) = store.session(headers["x-session-id"]).turns
    body = reply.model_dump()
    assert body["prompt_token_ids"] == list(turn.prompt_token_ids)
    assert body["choices"][0]["token_ids"] == list(turn.completion_token_ids)
    logprobs = [t.logprob for t in reply.choices[0].logprobs.content]
    assert logprobs == list(turn.completion_logprobs)


def test_a_stream_carries_every_sampled_tokens_logprob(client, store):
    raw = client.chat.completions.with_raw_response.create(
        model="policy", messages=USER, stream=True, logprobs=True, **SHORT
    )
    chunks = list(raw.parse())
    (turn,) = store.session(raw.headers["x-session-id"]).turns
    sent = [
        (e.token, e.logprob)
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert sent == [
        (f"token_id:{i}", lp)
        for i, lp in zip(turn.completion_token_ids, turn.completion_logprobs, strict=True)
    ]


def test_top_logprobs_are_served_as_openai_defines_them_and_stored(client, store):
    reply, headers = create(client, logprobs=True, top_logprobs=3, seed=4)
    (turn,) = store.session(headers["x-session-id"]).turns
    content = reply.choices[0].logprobs.content
    assert len(content) == len(turn.completion_token_ids) == len(turn.completion_top_ids) > 0
    for entry, ids, values in zip(
        content, turn.completion_top_ids, turn.completion_top_logprobs, strict=True
    ):
        assert [t.token for t in entry.top_logprobs] == [f"token_id:{i}" for i in ids]
        assert [t.logprob for t in entry.top_logprobs] == list(values)
        assert entry.top_logprobs[0].logprob >= entry.logprob  # likeliest first
    assert len(turn.completion_top_ids[0]) == 3
    # streamed, each chunk carries its tokens' top log-probs; logprobs alone carries none
    raw = client.chat.completions.with_raw_response.create(
        model="policy", messages=USER, stream=True, logprobs=True, top_logprobs=2, **SHORT
    )
    chunks = list(raw.parse())
    (streamed,) = store.session(raw.headers["x-session-id"]).turns
    sent = [
        tuple(int(t.token.split(":")[1]) for t in e.top_logprobs)
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert tuple(sent) == streamed.completion_top_ids
    plain, _ = create(client, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)


def test_a_proxy_that_keeps_top_k_stores_it_whatever_the_client_asks(tiny_engine, tmp_path):
    with served_client(tiny_engine, tmp_path, ProxyConfig(top_logprobs=4)) as (client, store):
        reply = client.chat.completions.create(model="policy", messages=USER, **SHORT)
        ((_, turn),) = store.turns()
    assert reply.choices[0].logprobs is None
    assert len(turn.completion_top_ids) == len(turn.completion_token_ids) > 0
    assert {len(top) for top in turn.completion_top_ids} == {4}
    rescored = tiny_engine.score(turn.prompt_token_ids, turn.completion_token_ids)
    assert rescored == pytest.approx(list(turn.completion_logprobs), abs=1e-4)


def test_stream_is_token_by_token_and_committed_before_done(client, store, tiny_engine):
    stream = client.chat.completions.create(
        model="policy",
        messages=USER,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Session-Id": "streamed"},
        max_completion_tokens=12,
        temperature=1.0,
        seed=5,
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    (turn,) = store.session("streamed").turns
    assert content == turn.completion["content"]
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        turn.completion_token_ids
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_n_choices_and_stop(client, store):
    reply, headers = create(client, n=3, stop=["\n"], max_tokens=8)
    turns = store.session(headers["x-session-id"]).turns
    assert len(reply.choices) == 3 and [t.index for t in turns] == [0, 1, 2]
    for choice, turn in zip(reply.choices, turns, strict=True):
        assert choice.message.content == turn.completion["content"]
        assert "\n" not in (choice.message.content or "")


def test_models_and_health(client, served):
    assert {m.id for m in client.models.list()} == {"policy", "base"}
    health = httpx.get(served[0].removesuffix("/v1") + "/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"


# -- sessions and headers ---------------------------------------------------------------


def test_turns_link_to_what_the_next_request_adds(client, store):
    first, _ = create(client, headers={"X-Session-Id": "linked"})
    answer = {"role": "assistant", "content": first.choices[0].message.content}
    reply = {"role": "user", "content": "No, try again."}
    create(client, [*USER, answer, reply, TRANSIENT], headers={"X-Session-Id": "linked"})
    turns = store.session("linked").turns
    assert turns[0].next_state == (reply,)
    assert turns[1].next_state is None and turns[1].prompt_messages[-1] == TRANSIENT


def test_side_turns_are_served_not_linked(client, store):
    headers = {"X-Session-Id": "sides"}
    first, _ = create(client, headers=headers)
    answer = {"role": "assistant", "content": first.choices[0].message.content}
    side, _ = create(
        client,
        [{"role": "user", "content": "flush memory"}],
        headers={**headers, "X-Turn-Type": "side"},
    )
    assert side.choices[0].message.role == "assistant"
    tool_reply = {"role": "user", "content": "thanks"}
    create(client, [*USER, answer, tool_reply], headers=headers)
    turns = store.session("sides").turns
    assert [t.turn_type for t in turns] == [TurnType.MAIN, TurnType.SIDE, TurnType.MAIN]
    assert turns[0].next_state == (tool_reply,) and turns[1].next_state is None


def test_no_session_id_gives_a_fresh_one_and_main_turns(client, store):
    ids = {create(client)[1]["x-session-id"] for _ in range(2)}
    assert len(ids) == 2
    assert all(store.session(i).turns[0].turn_type is TurnType.MAIN for i in ids)


def test_body_fields_stand_in_for_headers(client, store):
    create(client, extra_body={"session_id": "by-body", "turn_type": "side"})
    create(client, extra_body={"session_id": "by-body", "session_done": True})
    session = store.session("by-body")
    assert [t.turn_type for t in session.turns] == [TurnType.SIDE, TurnType.MAIN]
    assert session.status is SessionStatus.DONE


def test_session_done_closes_the_session(client, store):
    create(client, headers={"X-Session-Id": "closing", "X-Session-Done": "true"})
    assert store.session("closing").status is SessionStatus.DONE


def test_a_client_without_session_ids_trains_on_linked_turns(client, store):
    """A plain OpenAI client that only sends its history back: the proxy recognises the
    conversation, so the turns link as if it had sent X-Session-Id."""
    first, headers = create(client, [{"role": "user", "content": "plain client"}])
    answer = {"role": "assistant", "content": first.choices[0].message.content}
    reply = {"role": "user", "content": "thanks"}
    history = [{"role": "user", "content": "plain client"}, answer, reply]
    _, again = create(client, history)
    assert again["x-session-id"] == headers["x-session-id"]
    turns = store.session(headers["x-session-id"]).turns
    assert [t.next_state for t in turns] == [(reply,), None]


def test_an_idle_sessions_last_reply_ends_empty(tiny_engine, tmp_path):
    with served_client(tiny_engine, tmp_path, ProxyConfig(session_idle_s=1.0)) as (client, store):
        create(client, headers={"X-Session-Id": "quiet"})
        deadline = time.monotonic() + 10
        while store.session("quiet").turns[0].next_state is None:
            assert time.monotonic() < deadline, "the idle session's turn was never ended"
            time.sleep(0.1)
        assert store.session("quiet").turns[0].next_state == ()
        assert store.session("quiet").status is SessionStatus.OPEN


def test_a_closed_session_refuses_later_requests(client, store):
    create(client, headers={"X-Session-Id": "final", "X-Session-Done": "1"})
    with pytest.raises(openai.ConflictError) as raised:
        create(client, headers={"X-Session-Id": "final"})
    assert raised.value.body["code"] == "session_ended"
    assert len(store.session("final").turns) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_session_id_that_cannot_be_a_header_is_a_400(client, stream):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="policy", messages=USER, stream=stream, extra_body={"session_id": "\u00e9\u2603"}
        )
    assert raised.value.body["param"] == "X-Session-Id"
    assert create(client)[0].choices[0].message.role == "assistant"


def test_openclaw_affinity_headers_and_transient_context(client, store):
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    headers = {"session_id": "claw-1:0", "x-session-affinity": "claw-1:0"}
    history = [{"role": "system", "content": "You are OpenClaw."}, *USER]

    def turn(messages):
        stream = client.chat.completions.create(
            model="policy",
            messages=messages,
            tools=tools,
            tool_choice="auto",
            stream=True,
            stream_options={"include_usage": True},
            max_completion_tokens=6,
            extra_headers=headers,
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    said = turn([*history, TRANSIENT])
    reply = {"role": "user", "content": "ok"}
    turn([*history, {"role": "assistant", "content": said}, reply, TRANSIENT])
    turns = store.session("claw-1").turns
    assert len(turns) == 2 and turns[0].next_state == (reply,)
    assert turns[0].tools == tuple(tools)


def test_default_turn_type_is_configurable(tiny_engine, tmp_path):
    config = ProxyConfig(default_turn_type=TurnType.SIDE)
    with served_client(tiny_engine, tmp_path, config) as (client, store):
        _, headers = create(client)
        assert store.session(headers["x-session-id"]).turns[0].turn_type is TurnType.SIDE


def test_base_model_requests_are_side_turns(client, store):
    raw = client.chat.completions.with_raw_response.create(model="base", messages=USER, **SHORT)
    (turn,) = store.session(raw.headers["x-session-id"]).turns
    assert turn.turn_type is TurnType.SIDE and turn.policy_version == 0


def test_api_key_is_required_when_configured(tiny_engine, tmp_path):
    with (
        Store(tmp_path / "s.sqlite") as store,
        running(tiny_engine, store, ProxyConfig(api_key="sesame")) as (url, _),
    ):
        with pytest.raises(openai.AuthenticationError):
            create(openai.OpenAI(base_url=url, api_key="wrong", max_retries=0))
        reply, _ = create(openai.OpenAI(base_url=url, api_key="sesame", max_retries=0))
        assert reply.choices[0].message.role == "assistant"
        assert httpx.get(url.removesuffix("/v1") + "/healthz").status_code == 200
        # the scheme is case-insensitive (RFC 9110), the key is not
        assert httpx.get(url + "/models", headers={"authorization": "bearer sesame"}).is_success
        assert (
            httpx.get(url + "/models", headers={"authorization": "Bearer SESAME"}).status_code
            == 401
        )


# -- bad input ----------------------------------------------------------------------------

BAD_REQUESTS = {
    "unknown model": ({"model": "gpt-17"}, 404),
    "bad role": ({"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    "no messages": ({"messages": []}, 400),
    "user without content": ({"messages": [{"role": "user"}]}, 400),
    "bad tool type": ({"tools": [{"type": "web", "function": {"name": "f"}}]}, 400),
    "bad tool name": ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, 400),
    "tool parameters not an object": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
        400,
    ),
    "negative temperature": ({"temperature": -0.5}, 400),
    "huge temperature": ({"temperature": 1e9}, 400),
    "top_p zero": ({"top_p": 0}, 400),
    "max_tokens zero": ({"max_tokens": 0}, 400),
    "max_completion_tokens negative": ({"max_completion_tokens": -5}, 400),
    "n too large": ({"n": 10_000}, 400),
    "too many stops": ({"stop": ["a", "b", "c", "d", "e"]}, 400),
    "temperature not a number": ({"temperature": "hot"}, 400),
    "bad turn type": ({"extra_body": {"turn_type": "sideways"}}, 400),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_input_is_a_4xx_with_an_openai_error(client, served, case):
    change, status = BAD_REQUESTS[case]
    body = {"model": "policy", "messages": USER, "max_tokens": 2, **change}
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(**body)
    assert raised.value.status_code == status
    assert raised.value.body["message"] and raised.value.body["type"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_over_the_context_is_a_400(client, tiny_engine, stream):
    huge = [{"role": "user", "content": "word " * (tiny_engine.context_length + 10)}]
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="policy", messages=huge, stream=stream)
    assert raised.value.body["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "raw", [b"{not json", b"[1, 2]", b'{"model": "policy", "messages": "hi"}', b"\xff\xfe"]
)
def test_malformed_bodies_are_400s_and_the_server_lives(client, served, raw):
    response = httpx.post(
        served[0] + "/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and response.json()["error"]["message"]
    assert create(client)[0].choices[0].message.role == "assistant"


def test_nan_temperature_is_refused(served):
    raw = b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
    response = httpx.post(served[0] + "/chat/completions", content=raw)
    assert response.status_code == 400 and "temperature" in response.json()["error"]["message"]


def test_unknown_route_is_an_openai_style_404(served):
    response = httpx.get(served[0] + "/nothing")
    assert response.status_code == 404 and "error" in response.json()


@pytest.mark.parametrize(
    "body",
    [
        b'{"path": "/nonexistent/adapter", "version": 7}',
        b'{"path": 3}',
        b'{"version": "x"}',
        b'{"path": "/tmp", "version": 9223372036854775808}',  # 2**63: no SQLite integer
        b"[" * 5000 + b"]" * 5000,
    ],
)
def test_a_bad_publish_is_a_400_and_serving_goes_on(client, served, body):
    admin = {"Authorization": f"Bearer {served[2].admin_key}", "Content-Type": "application/json"}
    response = httpx.post(
        served[0].removesuffix("/v1") + "/admin/adapters", content=body, headers=admin
    )
    assert response.status_code == 400 and response.json()["error"]["message"]
    reply, headers = create(client)
    assert reply.choices[0].message.role == "assistant"
    assert served[1].session(headers["x-session-id"]).turns[0].policy_version == 0


def test_a_body_over_the_limit_is_a_413(tiny_engine, tmp_path):
    with served_client(tiny_engine, tmp_path, ProxyConfig(max_body_bytes=1000)) as (client, _):
        with pytest.raises(openai.APIStatusError) as raised:
            create(client, [{"role": "user", "content": "x" * 1000}])
        assert raised.value.status_code == 413 and raised.value.body["code"] == "request_too_large"
        assert create(client)[0].choices[0].message.role == "assistant"


def test_health_answers_head_and_models_are_retrievable(client, served):
    assert httpx.head(served[0].removesuffix("/v1") + "/healthz").status_code == 200
    assert client.models.retrieve("policy").id == "policy"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_the_store_cannot_commit_is_never_answered_as_done(
    client, served, monkeypatch, stream
):
    def full(turn):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(served[1], "add_turn", full)
    body = {"model": "policy", "messages": USER, "max_tokens": 3, "stream": stream}
    response = httpx.post(served[0] + "/chat/completions", json=body, timeout=60)
    if stream:
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert "disk is full" in json.loads(events[-1].removeprefix("data: "))["error"]["message"]
        assert "data: [DONE]" not in events
    else:
        assert response.status_code == 500 and "disk is full" in response.json()["error"]["message"]
    monkeypatch.undo()
    assert create(client)[0].choices[0].message.role == "assistant"


def test_wrong_method_on_chat_is_an_openai_style_405(served):
    response = httpx.get(served[0] + "/chat/completions")
    assert response.status_code == 405 and "error" in response.json()


def test_the_loop_leaves_wal_checkpoints_to_a_worker_thread(tiny_engine, tmp_path, monkeypatch):
    """Commits run on the event loop; SQLite's automatic checkpoint (an fsync, several ms)
    must not, so the proxy switches it off for the loop and checkpoints on a thread."""
    import threading

    from agents.serving import proxy

    monkeypatch.setattr(proxy, "CHECKPOINT_TURNS", 3)
    checkpoints: list[int] = []
    store = Store(tmp_path / "store.sqlite")
    original = store.checkpoint
    monkeypatch.setattr(
        store, "checkpoint", lambda: (checkpoints.append(threading.get_ident()), original())[1]
    )
    with running(tiny_engine, store) as (url, served):
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        for _ in range(7):
            create(client)
    assert len(checkpoints) == 2  # after turns 3 and 6
    loop_thread = served.checkpoints._loop_thread
    assert loop_thread is not None and loop_thread not in checkpoints
    assert store.count_turns() == 7
    store.close()


def test_checkpoints_keep_the_log_bounded_while_writes_never_stop(tmp_path, monkeypatch):
    """Turns written back to back on the loop, as fast as the store takes them: writes
    wait for each checkpoint, so the log starts over after it. (Writes that went on during
    checkpoints left a 35 MB log after 2000 turns.)"""
    import asyncio

    from agents.serving import proxy
    from agents.trajectory import Session
    from tests.agents.test_trajectory import make_turn

    monkeypatch.setattr(proxy, "CHECKPOINT_TURNS", 32)
    store = Store(tmp_path / "store.sqlite")
    store.add_session(Session("s", "live"))
    checkpoints = proxy.Checkpoints(store)
    ran: list[int] = []
    original = store.checkpoint
    monkeypatch.setattr(store, "checkpoint", lambda: (ran.append(1), original())[1])

    async def write_back_to_back() -> None:
        for index in range(2000):
            await checkpoints.writable()
            store.add_turn(make_turn(index=index))
            checkpoints.wrote(1)
            await asyncio.sleep(0)  # what a request's other awaits give the loop

    asyncio.run(write_back_to_back())
    assert store.count_turns() == 2000
    assert len(ran) == 2000 // 32
    # About 4 pages a turn: 32 turns between two checkpoints is about 0.6 MB.
    assert (tmp_path / "store.sqlite-wal").stat().st_size < 2_000_000
    store.close()


@pytest.mark.parametrize(("n", "stream"), [(1, True), (2, True), (1, False), (2, False)])
def test_a_client_that_leaves_cancels_its_engine_requests(client, served, tiny_engine, n, stream):
    # seed 25 makes `tiny` decode all 3000 tokens (about 15 s) instead of meeting its EOS
    body = {"model": "policy", "messages": USER, "max_tokens": 3000, "seed": 25, "n": n}
    url, session = served[0] + "/chat/completions", {"X-Session-Id": f"leaves-{n}-{stream}"}
    if stream:
        with httpx.stream(
            "POST", url, json={**body, "stream": True}, headers=session, timeout=60
        ) as sse:
            lines = sse.iter_lines()
            assert next(lines).startswith("data: ")
            next(lines)
    else:
        with pytest.raises(httpx.ReadTimeout):  # leaves while the engine decodes
            httpx.post(url, json=body, headers=session, timeout=0.5)
    scheduler = tiny_engine._scheduler
    deadline = time.monotonic() + 30
    while (scheduler._batch is not None or scheduler._waiting) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scheduler._batch is None and not scheduler._waiting  # no row decodes on for nobody
    assert served[1].session(f"leaves-{n}-{stream}").turns == ()  # nothing finished
    reply, _ = create(client)
    assert reply.choices[0].message.role == "assistant"


def test_the_served_models_name_is_listed_and_answers(tiny_engine, tmp_path):
    with served_client(tiny_engine, tmp_path, ProxyConfig(model_name="tiny")) as (client, store):
        assert [m.id for m in client.models.list()] == ["policy", "tiny", "base"]
        assert client.models.retrieve("tiny").id == "tiny"
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=USER, **SHORT)
        (turn,) = store.session(raw.headers["x-session-id"]).turns
        assert turn.turn_type is TurnType.MAIN  # the policy under its own name


@pytest.mark.parametrize("server_future", [True, False])
def test_a_client_leaving_cancels_the_calls_with_or_without_the_servers_future(server_future):
    """`_all` learns of the client leaving from `agents.serving.http_protocol`'s future, or, under
    another ASGI server, from `receive()`."""
    from starlette.requests import ClientDisconnect

    from agents.serving.chat_turn import _all
    from agents.serving.http_protocol import CONNECTION_LOST

    async def scenario():
        loop = asyncio.get_running_loop()
        lost, never = loop.create_future(), loop.create_future()
        scope = {"type": "http", "extensions": {CONNECTION_LOST: lost}} if server_future else {}

        async def receive():
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}

        async def decode():
            await never

        calls = [decode(), decode()]
        loop.call_later(0.05, lost.set_result, None)
        with pytest.raises(ClientDisconnect):
            await asyncio.wait_for(_all(calls, scope, receive), timeout=5)
        if server_future:  # the connection is gone: nothing more is served on it
            with pytest.raises(ClientDisconnect):
                await _all([asyncio.sleep(0, "done")], scope, receive)
        else:  # a call that ends before the client leaves is answered
            assert await _all([asyncio.sleep(0, "done")], scope, receive) == ["done"]

    asyncio.run(scenario())
