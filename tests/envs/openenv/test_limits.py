"""The OpenEnv server's limits against clients that hold what they can, on loopback with
OpenEnv's own client (`ChatEnvClient`) and raw HTTP (httpx, sockets): past the per-client
cap a 429, past the global cap a 503; an HTTP-made session is its maker's alone and closed
when idle; idle and slow connections are closed; the owner's sessions play on and the server
stays up. Without keys a client is its address: other clients connect from 127.0.0.2."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from envs.openenv.limits import ServerLimits
from envs.openenv.protocol import ChatAction, ChatEnvClient

CREATE = {"jsonrpc": "2.0", "method": "openenv/session/create", "params": {}, "id": 1}


def from_address(address: str) -> httpx.Client:
    """An HTTP client whose connections come from `address` (another loopback client)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=30)


def create(client: httpx.Client, base_url: str) -> httpx.Response:
    return client.post(base_url + "/mcp", json=CREATE)


def close(client: httpx.Client, base_url: str, session_id: str) -> httpx.Response:
    body = CREATE | {"method": "openenv/session/close", "params": {"session_id": session_id}}
    return client.post(base_url + "/mcp", json=body)


def plays(base_url: str, api_key: str | None = None) -> ChatEnvClient:
    """A connected WebSocket session that has reset its episode."""
    client = ChatEnvClient(base_url, api_key).sync()
    client.connect()
    assert client.reset(seed=0).observation.info["task_id"]
    return client


def test_a_client_past_its_cap_gets_a_429_and_others_play_on(serve):
    served = serve(
        "clawgym/Arith-v0", limits=ServerLimits(max_sessions=4, max_sessions_per_client=2)
    )
    mine = [plays(served.base_url), plays(served.base_url)]
    with pytest.raises(ConnectionError, match="429"):
        ChatEnvClient(served.base_url).sync().connect()
    local = from_address("127.0.0.1")
    refused = create(local, served.base_url)
    assert refused.status_code == 429 and "max_sessions_per_client" in refused.json()["detail"]
    other = from_address("127.0.0.2")
    first = create(other, served.base_url).json()["result"]["session_id"]
    assert create(other, served.base_url).json()["result"]["session_id"] != first
    assert create(from_address("127.0.0.3"), served.base_url).status_code == 503  # all 4 held
    for client in mine:  # the first client's sessions are intact
        assert client.step(ChatAction(message="no answer")).observation.messages is not None
        assert client.state().step_count == 1
    mine.pop().disconnect()
    assert close(other, served.base_url, first).json()["result"]["closed"]
    assert served.sessions.active_sessions == 2
    mine.append(plays(served.base_url))  # a freed slot is a slot again
    for client in mine:
        client.disconnect()
    assert httpx.get(served.base_url + "/health").status_code == 200


def test_an_http_session_is_its_makers_alone(serve):
    served = serve("clawgym/Arith-v0")
    owner, other = from_address("127.0.0.1"), from_address("127.0.0.2")
    session_id = create(owner, served.base_url).json()["result"]["session_id"]
    refused = close(other, served.base_url, session_id)
    assert refused.status_code == 404 and "unknown session_id" in refused.json()["detail"]
    body = CREATE | {"method": "tools/list", "params": {"session_id": session_id}}
    assert other.post(served.base_url + "/mcp", json=body).status_code == 404
    assert served.sessions.active_sessions == 1
    assert close(owner, served.base_url, session_id).json()["result"]["closed"]
    assert served.sessions.active_sessions == 0


def test_an_idle_http_session_is_closed_with_its_env_and_a_websocket_plays_on(serve):
    served = serve(
        "clawgym/Arith-v0", limits=ServerLimits(max_sessions_per_client=2, session_idle_s=0.5)
    )
    player = plays(served.base_url)
    local = from_address("127.0.0.1")
    session_id = create(local, served.base_url).json()["result"]["session_id"]
    assert create(local, served.base_url).status_code == 429
    deadline = time.monotonic() + 10
    while served.sessions.active_sessions > 1:
        assert time.monotonic() < deadline, "the idle HTTP session was never closed"
        time.sleep(0.1)
    assert close(local, served.base_url, session_id).status_code == 404  # gone
    assert player.step(ChatAction(message="no answer")).observation.messages is not None
    assert create(local, served.base_url).status_code == 200  # its slot is free again
    player.disconnect()


def test_a_keyed_server_counts_sessions_by_key(serve):
    limits = ServerLimits(max_sessions_per_client=1)
    served = serve("clawgym/Arith-v0", api_key="s3cret", limits=limits)
    player = plays(served.base_url, "s3cret")
    with pytest.raises(ConnectionError, match="429"):
        ChatEnvClient(served.base_url, "s3cret").sync().connect()
    with pytest.raises(ConnectionError, match="401|403"):  # no key: refused before counting
        ChatEnvClient(served.base_url, "wrong").sync().connect()
    assert player.step(ChatAction(message="no answer")).observation.messages is not None
    player.disconnect()


def test_idle_and_slow_connections_are_closed(serve):
    limits = ServerLimits(idle_timeout_s=0.5, request_timeout_s=1.0)
    served = serve("clawgym/Arith-v0", limits=limits)
    port = int(served.base_url.rsplit(":", 1)[1])
    idle, slow = socket.create_connection(("127.0.0.1", port)), None
    try:
        idle.settimeout(10)
        assert idle.recv(1) == b""  # closed without a request ever sent
        slow = socket.create_connection(("127.0.0.1", port))
        slow.settimeout(10)
        started = time.monotonic()
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n" * 100:
                slow.send(bytes([byte]))
                time.sleep(0.05)
        assert time.monotonic() - started < 8
    finally:
        idle.close()
        if slow is not None:
            slow.close()
    player = plays(served.base_url)  # a WebSocket outlives the HTTP timeouts
    time.sleep(1.5)
    assert player.step(ChatAction(message="no answer")).observation.messages is not None
    player.disconnect()
    assert httpx.get(served.base_url + "/health").status_code == 200


def test_a_quiet_websocket_is_closed_and_frees_its_session(serve):
    """A WebSocket held open by a live peer (it answers uvicorn's pings) that sends no
    message for `websocket_idle_s` is closed with code 1001, its session and env go, and
    its slot is free; a client that keeps talking is never closed."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    limits = ServerLimits(max_sessions_per_client=3, websocket_idle_s=0.6)
    served = serve("clawgym/Arith-v0", limits=limits)
    quiet = plays(served.base_url)
    talker = plays(served.base_url)
    raw = connect(served.base_url.replace("http", "ws") + "/ws")
    deadline = time.monotonic() + 10
    while served.sessions.active_sessions > 1:
        assert time.monotonic() < deadline, "the quiet sessions were never closed"
        assert talker.step(ChatAction(message="no answer")).observation.messages is not None
        time.sleep(0.2)
    with pytest.raises(ConnectionClosed) as closed:
        raw.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
    assert "websocket_idle_s" in closed.value.rcvd.reason
    with pytest.raises(ConnectionClosed, match="1001 .*websocket_idle_s"):  # OpenEnv's client
        quiet.step(ChatAction(message="no answer"))
    again = plays(served.base_url)  # the quiet ones' slots are free
    assert again.step(ChatAction(message="no answer")).observation.messages is not None
    for client in (again, talker):
        client.disconnect()
    assert httpx.get(served.base_url + "/health").status_code == 200
