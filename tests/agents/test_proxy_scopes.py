"""The proxy's sessions scoped by credential, against a client that means harm (mallory),
over the real embedded engine on `tiny`, a real uvicorn server on a loopback port with no
API key (where any credential is let in) and the real `openai` client: mallory naming
alice's session id appends to, fills, pre-claims and closes only a session of her own;
alice's turns, next states and budget are intact, and the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from agents.engines.embedded import EmbeddedEngine
from agents.serving import sessions
from agents.serving.identity import credential, home_credentials, scope_of, stored_id
from agents.serving.proxy import Proxy, ProxyConfig
from agents.store import Store
from agents.trajectory import SessionStatus
from tests.agents.serving import running

USER = {"role": "user", "content": "What is 2 + 2?"}
SHORT = {"max_tokens": 4, "temperature": 1.0}


@pytest.fixture(scope="module")
def tiny_engine() -> Iterator[EmbeddedEngine]:
    engine = EmbeddedEngine("tiny", threads=1)
    yield engine
    engine.close()


@pytest.fixture
def served(tiny_engine, tmp_path) -> Iterator[tuple[str, Store, Proxy]]:
    """A proxy with no API key (on loopback, as by default): (root URL, store, proxy)."""
    with Store(tmp_path / "s.sqlite") as store, running(tiny_engine, store) as (url, proxy):
        yield url.removesuffix("/v1"), store, proxy


def as_client(root: str, key: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=root + "/v1", api_key=key, max_retries=0, default_headers=headers or None
    )


def chat(
    client: openai.OpenAI, session: str | None, messages: list | None = None, done: bool = False
) -> tuple[dict[str, str], dict]:
    """One turn: the response's headers and reply message."""
    headers = ({"X-Session-Id": session} if session else {}) | (
        {"X-Session-Done": "1"} if done else {}
    )
    raw = client.chat.completions.with_raw_response.create(
        model="policy", messages=messages or [USER], extra_headers=headers, **SHORT
    )
    reply = raw.parse().choices[0].message
    return dict(raw.headers), {"role": "assistant", "content": reply.content or ""}


def alices(session: str = "alices") -> str:
    """The store's id of alice's `session` (on a proxy without a key)."""
    return stored_id(scope_of(b"Bearer alice-key", home_credentials(None)), session)


def test_a_session_id_names_one_session_per_credential(served):
    """Appending, pre-claiming and closing: mallory's turns go to a session of her own."""
    root, store, _ = served
    alice, mallory = as_client(root, "alice-key"), as_client(root, "mallory-key")
    chat(mallory, "alices", done=True)  # claims the id first, and closes it
    headers, first = chat(alice, "alices")
    assert headers["x-session-id"] == "alices"  # the client's id comes back as it sent it
    with pytest.raises(openai.ConflictError):  # mallory's own session is over
        chat(mallory, "alices", [USER])
    answer = {"role": "user", "content": "And 3 + 3?"}
    chat(alice, "alices", [USER, first, answer])
    mine = store.session(alices())
    assert mine.status is SessionStatus.OPEN and [t.index for t in mine.turns] == [0, 1]
    assert mine.turns[0].next_state == (answer,)
    with pytest.raises(KeyError):  # no home client named it
        store.session_status("alices")
    chat(alice, "alices", done=True)
    assert store.session_status(alices()) is SessionStatus.DONE
    assert httpx.get(root + "/healthz").status_code == 200


def test_another_credential_cannot_use_up_a_sessions_open_ends(served, monkeypatch):
    """Mallory's turns that await replies count against her own session's budget only:
    alice's waiting turn still gets its next state."""
    root, store, _ = served
    monkeypatch.setattr(sessions, "MAX_OPEN_ENDS", 2)
    alice, mallory = as_client(root, "alice-key"), as_client(root, "mallory-key")
    _, first = chat(alice, "alices")
    for _ in range(4):
        chat(mallory, "alices", [{"role": "user", "content": "filler"}])
    answer = {"role": "user", "content": "Thanks."}
    chat(alice, "alices", [USER, first, answer])
    assert store.session(alices()).turns[0].next_state == (answer,)
    assert len(store.session(alices()).turns) == 2


def test_a_history_sent_back_is_recognised_within_its_credential_only(served):
    """OpenClaw-style clients send no id: alice's history links her turns; the same history
    from mallory starts a session of mallory's and links nothing of alice's."""
    root, store, _ = served
    alice, mallory = as_client(root, "alice-key"), as_client(root, "mallory-key")
    headers, first = chat(alice, None)
    minted = headers["x-session-id"]
    stolen = [USER, first, {"role": "user", "content": "mallory's words"}]
    theirs, _ = chat(mallory, None, stolen)
    assert theirs["x-session-id"] != minted
    answer = {"role": "user", "content": "alice's words"}
    again, _ = chat(alice, None, [USER, first, answer])
    assert again["x-session-id"] == minted
    turns = store.session(alices(minted)).turns
    assert len(turns) == 2 and turns[0].next_state == (answer,)


def test_the_scheme_is_read_in_any_case_and_one_canonical_form(served):
    root, store, _ = served
    lower = as_client(root, "ignored", Authorization="bearer   alice-key")
    chat(as_client(root, "alice-key"), "alices")
    chat(lower, "alices")
    assert len(store.session(alices()).turns) == 2
    assert credential({"authorization": "BEARER x"}) == credential({"authorization": "Bearer x"})
    assert credential({"authorization": "Bearer "}) == credential({}) == b""


def test_an_episode_is_reached_by_the_proxys_own_clients_only(served):
    """The episode routes' sessions keep their ids: the proxy's own clients (no key, or
    `none`) chat in them; mallory naming one gets her own, and cannot close it."""
    root, store, proxy = served
    admin = {"Authorization": f"Bearer {proxy.admin_key}"}
    body = {"session_id": "episode", "env_id": "clawgym/Arith-v0"}
    assert httpx.post(root + "/admin/sessions", json=body, headers=admin).is_success
    headers, _ = chat(as_client(root, "none"), "episode")
    assert headers["x-turn-index"] == "0"
    mallory = as_client(root, "mallory-key")
    chat(mallory, "episode")
    chat(mallory, "episode", done=True)
    with pytest.raises(openai.PermissionDeniedError) as refused:  # its admin route ends it
        chat(as_client(root, "none"), "episode", done=True)
    assert refused.value.body["code"] == "session_not_owned"
    assert store.session_status("episode") is SessionStatus.OPEN
    assert len(store.session("episode").turns) == 1
    end = {"messages": [], "outcome_reward": 1.0}
    assert httpx.post(root + "/admin/sessions/episode/end", json=end, headers=admin).is_success


def test_a_client_cannot_name_a_scoped_id(served):
    """No client (nor the admin routes) may name a stored id of another credential."""
    root, store, proxy = served
    chat(as_client(root, "alice-key"), "alices")
    with pytest.raises(openai.BadRequestError) as refused:
        chat(as_client(root, "none"), alices())
    assert refused.value.body["param"] == "X-Session-Id"
    admin = {"Authorization": f"Bearer {proxy.admin_key}"}
    body = {"session_id": alices(), "env_id": "clawgym/Arith-v0"}
    assert httpx.post(root + "/admin/sessions", json=body, headers=admin).status_code == 400
    assert len(store.session(alices()).turns) == 1


def test_a_scope_outlives_the_proxy(tiny_engine, tmp_path):
    """The same credential reaches the same session after a restart; another never does."""
    with Store(tmp_path / "s.sqlite") as store:
        with running(tiny_engine, store) as (url, _):
            _, first = chat(as_client(url.removesuffix("/v1"), "alice-key"), "kept")
        with running(tiny_engine, store) as (url, _):
            root = url.removesuffix("/v1")
            chat(as_client(root, "mallory-key"), "kept", done=True)
            chat(as_client(root, "alice-key"), "kept", [USER, first, USER], done=True)
        session = store.session(alices("kept"))
        assert session.status is SessionStatus.DONE and len(session.turns) == 2
        assert "alice-key" not in str(session.metadata) + session.session_id


def test_a_keyed_proxy_takes_its_key_in_any_case_and_keeps_ids_as_sent(tiny_engine, tmp_path):
    config = ProxyConfig(api_key="sesame")
    with Store(tmp_path / "s.sqlite") as store, running(tiny_engine, store, config) as (url, _):
        root = url.removesuffix("/v1")
        chat(as_client(root, "x", Authorization="BEARER sesame"), "kept")
        with pytest.raises(openai.AuthenticationError):
            chat(as_client(root, "x", Authorization="Bearer sesame2"), "kept")
        assert len(store.session("kept").turns) == 1
