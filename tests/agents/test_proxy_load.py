"""The proxy under load, on the real embedded engine: 50 concurrent sessions with every
turn recorded and linked, and adapter versions published while requests stream, with
not one request failing."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from agents.engines.embedded import EmbeddedEngine
from agents.serving.proxy import ProxyConfig
from agents.store import Store
from agents.trajectory import SessionStatus, TurnType
from tests.agents.engines.conftest import save_random_adapter
from tests.agents.serving import running

TRANSIENT = {"role": "user", "content": "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> clock"}


def chat(client, session_id, messages, done=False, stream=False):
    headers = {"X-Session-Id": session_id, **({"X-Session-Done": "1"} if done else {})}
    result = client.chat.completions.create(
        model="policy",
        messages=messages,
        max_tokens=4,
        temperature=1.0,
        extra_headers=headers,
        stream=stream,
    )
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in result if c.choices)
    return result.choices[0].message.content


def conversation(client, number):
    """Three main turns, the last closing the session; OpenClaw's transient message on each."""
    session_id = f"load-{number}"
    history = [{"role": "user", "content": f"question {number}"}]
    for turn in range(3):
        said = chat(client, session_id, [*history, TRANSIENT], done=turn == 2, stream=turn == 1)
        history += [
            {"role": "assistant", "content": said},
            {"role": "user", "content": f"reply {turn}"},
        ]
    return session_id


def test_fifty_concurrent_sessions_are_recorded_and_linked(tmp_path):
    engine = EmbeddedEngine("tiny", threads=1)  # one thread: fastest for a 4M-parameter model
    with Store(tmp_path / "s.sqlite") as store, running(engine, store) as (url, _):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
        with ThreadPoolExecutor(50) as pool:
            ids = list(pool.map(lambda n: conversation(client, n), range(50)))
        for session_id in ids:
            session = store.session(session_id)
            assert session.status is SessionStatus.DONE
            assert [t.index for t in session.turns] == [0, 1, 2]
            assert all(t.turn_type is TurnType.MAIN for t in session.turns)
            assert [t.next_state for t in session.turns] == [
                ({"role": "user", "content": "reply 0"},),
                ({"role": "user", "content": "reply 1"},),
                None,
            ]
            assert all(
                len(t.completion_token_ids) == len(t.completion_logprobs) > 0 for t in session.turns
            )
    engine.close()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return [str(save_random_adapter(root / f"v{v}", seed=v)) for v in (1, 2, 3)]


def test_publishing_adapters_under_load_fails_no_request(tmp_path, adapters):
    engine = EmbeddedEngine("tiny", threads=1)
    failures, served = [], []
    stop = threading.Event()

    def load(client, worker):
        while not stop.is_set():
            try:
                chat(
                    client,
                    f"swap-{worker}",
                    [{"role": "user", "content": "hi"}],
                    stream=worker % 2 == 0,
                )
                served.append(worker)
            except Exception as error:  # any failure at all is what this test counts
                failures.append(repr(error))

    config = ProxyConfig()
    with Store(tmp_path / "s.sqlite") as store, running(engine, store, config) as (url, proxy):
        admin = {"Authorization": f"Bearer {proxy.admin_key}"}
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
        workers = [threading.Thread(target=load, args=(client, w)) for w in range(8)]
        for worker in workers:
            worker.start()
        answers = []
        for version, path in enumerate(adapters, start=1):
            before = len(served)
            while len(served) < before + 4:  # let requests run on the previous version
                stop.wait(0.05)
            response = httpx.post(
                url.removesuffix("/v1") + "/admin/adapters",
                json={"path": path, "version": version},
                headers=admin,
                timeout=120,
            )
            answers.append(response.status_code)
            assert chat(client, "probe", [{"role": "user", "content": "v?"}])
            assert store.session("probe").turns[-1].policy_version == version
        stop.set()
        for worker in workers:
            worker.join()
        versions = {t.policy_version for _, t in store.turns()}
        stale = httpx.post(
            url.removesuffix("/v1") + "/admin/adapters",
            json={"path": adapters[0], "version": 1},
            headers=admin,
        )
    engine.close()
    assert failures == []
    assert answers == [200, 200, 200] and stale.status_code == 409
    assert {0, 1, 2, 3} <= versions
