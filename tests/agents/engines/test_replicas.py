"""Replicas behind the one proxy (`agents.engines.replicas`), on two real embedded engines
of `tiny`: a session's turns all reach one replica, sessions spread over both, and an
adapter published while requests are in flight reaches every replica with no request
failing; and with a real vLLM replica killed, its sessions go to the other, the request
that found it dead is answered there, and a replacement comes back with the newest adapter.
"""

import asyncio
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from agents.engines.base import SamplingParams
from agents.engines.embedded import EmbeddedEngine
from agents.engines.replicas import ReplicaSet, replica_of
from tests.agents.serving import served_client


class Counted:
    """A real engine, counting the chat requests it served by session (the proxy passes
    none: it asks the replica set which engine a session's requests go to)."""

    def __init__(self, engine):
        self.engine, self.served, self._lock = engine, 0, threading.Lock()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def agenerate(self, *args, **kwargs):
        with self._lock:
            self.served += 1
        return await self.engine.agenerate(*args, **kwargs)


@pytest.fixture(scope="module")
def two_replicas():
    engines = [Counted(EmbeddedEngine("tiny", threads=1)) for _ in range(2)]
    replicas = ReplicaSet(engines)
    yield replicas
    replicas.close()


def test_a_session_keeps_its_replica_and_only_a_lost_replicas_sessions_move():
    # blake2b-64 of "session-0:0", ":1", ":2": 0x470e..., 0xa21a..., 0x93a5...
    assert replica_of("session-0", [0, 1, 2]) == 1 and replica_of("session-0", [0, 2]) == 2
    sessions = [f"s{n}" for n in range(64)]
    three = {s: replica_of(s, [0, 1, 2]) for s in sessions}
    assert set(three.values()) == {0, 1, 2}
    without_one = {s: replica_of(s, [0, 2]) for s in sessions}
    moved = {s for s in sessions if three[s] != without_one[s]}
    assert moved == {s for s in sessions if three[s] == 1}


def test_every_turn_of_a_session_reaches_its_replica(two_replicas, tmp_path):
    sessions = [f"session-{n}" for n in range(6)]
    before = [engine.served for engine in two_replicas.engines]
    expected = [0, 0]
    with served_client(two_replicas, tmp_path) as (client, _):
        for session in sessions:
            owner = replica_of(session, [0, 1])
            for turn in range(2):
                served = [engine.served for engine in two_replicas.engines]
                client.chat.completions.create(
                    model="policy",
                    messages=[{"role": "user", "content": f"turn {turn}"}],
                    max_tokens=2,
                    extra_headers={"X-Session-Id": session},
                )
                after = [engine.served for engine in two_replicas.engines]
                assert after[owner] == served[owner] + 1 and after[1 - owner] == served[1 - owner]
            expected[owner] += 2
    gained = [engine.served - b for engine, b in zip(two_replicas.engines, before, strict=True)]
    assert gained == expected and all(gained)  # both replicas served sessions


def test_an_adapter_published_under_load_reaches_every_replica_and_no_request_fails(
    two_replicas, tiny_adapters, tmp_path
):
    stop = threading.Event()
    versions: list[int] = []

    def keep_asking(session):
        engine = two_replicas.for_session(session).replica()
        while not stop.is_set():
            completion = engine.generate(
                [{"role": "user", "content": "hello"}], sampling=SamplingParams(max_tokens=4)
            )
            versions.append(completion.policy_version)

    start = two_replicas.policy_version
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(keep_asking, f"s{n}") for n in range(4)]
        for step, path in enumerate((tiny_adapters[1], tiny_adapters[2]), start=1):
            two_replicas.load_adapter(str(path), start + step)
        stop.set()
        for future in running:
            future.result()  # raises if any request failed
    assert [e.policy_version for e in two_replicas.engines] == [start + 2] * 2
    assert two_replicas.policy_version == start + 2
    assert versions and set(versions) <= {start, start + 1, start + 2}


@pytest.mark.slow
@pytest.mark.vllm
def test_a_killed_replica_loses_only_its_sessions_and_is_replaced(vllm_alone, tiny_adapters):
    from agents.engines.vllm import VLLMEngine

    made = []

    def replace(index):
        made.append(EmbeddedEngine("tiny", threads=1))
        return made[-1]

    vllm, embedded = VLLMEngine("tiny"), EmbeddedEngine("tiny", threads=1)
    replicas = ReplicaSet([vllm, embedded], replace=replace)
    try:
        on_vllm = next(f"s{n}" for n in range(64) if replica_of(f"s{n}", [0, 1]) == 0)
        replicas.load_adapter(str(tiny_adapters[1]), 1)
        os.killpg(vllm.pid, signal.SIGKILL)
        question = [{"role": "user", "content": "hello"}]
        session = replicas.for_session(on_vllm)
        answer = asyncio.run(session.agenerate(question, sampling=SamplingParams(max_tokens=4)))
        assert answer.completion_token_ids and answer.policy_version == 1  # answered by 1
        deadline = time.monotonic() + 120
        while replicas.replaced < 1:
            assert time.monotonic() < deadline, "no replacement came"
            time.sleep(0.2)
        assert replicas.live == [0, 1] and replicas.engines[0] is made[0]
        assert made[0].policy_version == 1  # the newest adapter, loaded before it served
        assert session.replica() is made[0]  # the session is back on its own replica
    finally:
        replicas.close()
