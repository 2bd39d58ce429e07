"""Users' keys on the proxy (`serve.api_keys`, a keys file; `agents.api_keys`), over the real
embedded engine on `tiny`, a real uvicorn server on a loopback port and the real `openai`
client: a request needs one of the configured keys; a user's sessions are the user's,
whichever of their keys (in whatever scheme case) they send; another user naming the same
id gets a session of their own and can close none of theirs; the proxy's own key keeps its
ids as sent; nothing stored holds a key."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from agents.compose import proxy_config
from agents.config import ModelConfig, ServeSection
from agents.engines.embedded import EmbeddedEngine
from agents.serving.identity import bearer, home_credentials, scope_of, stored_id
from agents.serving.identity import user_credentials as lookup
from agents.serving.proxy import Proxy
from agents.store import Store
from agents.trajectory import SessionStatus
from tests.agents.serving import running
from tests.agents.test_proxy_scopes import USER, as_client, chat

HOME, ALICE_OLD, ALICE_NEW, BOB = "home-key", "alice-old", "alice-new", "bob-key"


@pytest.fixture(scope="module")
def tiny_engine() -> Iterator[EmbeddedEngine]:
    engine = EmbeddedEngine("tiny", threads=1)
    yield engine
    engine.close()


@pytest.fixture
def served(tiny_engine, tmp_path) -> Iterator[tuple[str, Store, Proxy]]:
    """A proxy with its own key and three users' keys, two of them alice's (one from the
    config list, one from a keys file): (root URL, store, proxy)."""
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# alice's key is being rotated\nalice {ALICE_NEW}\n")
    section = ServeSection(api_key=HOME, api_keys=[f"alice {ALICE_OLD}", BOB])
    section.api_keys_file = str(keys_file)
    config = proxy_config(section, ModelConfig("tiny"))
    with Store(tmp_path / "s.sqlite") as store, running(tiny_engine, store, config) as (url, p):
        yield url.removesuffix("/v1"), store, p


def alices(proxy: Proxy, session: str) -> str:
    """The store's id of alice's `session`: the same whichever of her keys sent it."""
    old = stored_id(scope_of(bearer(ALICE_OLD), proxy.home, proxy.users), session)
    assert old == stored_id(scope_of(bearer(ALICE_NEW), proxy.home, proxy.users), session)
    return old


def test_only_a_configured_key_is_let_in(served):
    root, store, _ = served
    for refused in ("none", "alice", "bob-key2", ALICE_OLD.upper()):
        with pytest.raises(openai.AuthenticationError):
            chat(as_client(root, refused), "s")
    anonymous = httpx.post(root + "/v1/chat/completions", json={"model": "policy"})
    assert anonymous.status_code == 401
    headers, _ = chat(as_client(root, HOME), "mine")  # the proxy's own key: ids as sent
    assert headers["x-session-id"] == "mine" and len(store.session("mine").turns) == 1
    assert httpx.get(root + "/healthz").status_code == 200


def test_a_users_keys_share_the_users_sessions(served):
    root, store, proxy = served
    _, first = chat(as_client(root, ALICE_OLD), "talk")
    lower = as_client(root, "ignored", Authorization=f"bearer  {ALICE_NEW}")
    answer = {"role": "user", "content": "And 3 + 3?"}
    headers, _ = chat(lower, "talk", [USER, first, answer])
    assert headers["x-session-id"] == "talk"
    session = store.session(alices(proxy, "talk"))
    assert [t.index for t in session.turns] == [0, 1] and session.turns[0].next_state == (answer,)
    chat(as_client(root, ALICE_NEW), "talk", done=True)  # opened with the old key: still hers
    assert store.session_status(alices(proxy, "talk")) is SessionStatus.DONE
    stored = session.session_id + str(session.metadata)
    assert ALICE_OLD not in stored and ALICE_NEW not in stored and "alice" not in stored


def test_another_user_naming_the_id_gets_a_session_of_their_own(served):
    root, store, proxy = served
    chat(as_client(root, ALICE_OLD), "talk")
    bob = as_client(root, BOB)
    chat(bob, "talk")
    chat(bob, "talk", done=True)  # closes bob's session only
    assert store.session_status(alices(proxy, "talk")) is SessionStatus.OPEN
    assert len(store.session(alices(proxy, "talk")).turns) == 1
    with pytest.raises(KeyError):  # the home client never named it
        store.session_status("talk")
    chat(as_client(root, ALICE_NEW), "talk", done=True)
    assert store.session_status(alices(proxy, "talk")) is SessionStatus.DONE


def test_users_keys_without_the_proxys_own_key_leave_no_client_keyless(tiny_engine, tmp_path):
    section = ServeSection(api_keys=[f"alice {ALICE_OLD}"])
    config = proxy_config(section, ModelConfig("tiny"))
    assert home_credentials(None, users=True) == frozenset()
    assert lookup(config.user_keys)  # alice's key, by its hash
    with Store(tmp_path / "s.sqlite") as store, running(tiny_engine, store, config) as (url, p):
        root = url.removesuffix("/v1")
        with pytest.raises(openai.AuthenticationError):
            chat(as_client(root, "none"), "s")
        body = {"model": "policy", "messages": [USER], "max_tokens": 2}
        assert httpx.post(root + "/v1/chat/completions", json=body).status_code == 401
        chat(as_client(root, ALICE_OLD), "s")
        alice = scope_of(bearer(ALICE_OLD), p.home, p.users)
        assert len(store.session(stored_id(alice, "s")).turns) == 1
