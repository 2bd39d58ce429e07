"""The Tinker server's limits, fairness, released resources, bad input and connection
timeouts, on loopback with the real `tinker` SDK (raw HTTP only for bodies the SDK never
sends) (#41)."""

import socket
import threading
import time

import httpx
import pytest
import tinker
from tinker import types

from trainers.tinker.app import in_thread
from trainers.tinker.errors import TooMany
from trainers.tinker.futures import Futures
from trainers.tinker.limits import TinkerLimits
from trainers.tinker.service import TinkerService

KEY = "tml-limits"
PROMPT = [1, 5, 9, 200, 31, 7]
LIMITS = TinkerLimits(
    max_lora_rank=8,
    max_seq_len=64,
    max_num_samples=4,
    max_tokens=16,
    max_body_bytes=64 << 10,
    max_training_clients=2,
    max_samplers=3,
    max_sampler_copies=2,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    service = TinkerService("tiny", tmp_path_factory.mktemp("tinker-limits"), limits=LIMITS)
    with in_thread(service, api_key=KEY) as url:
        yield url, service


@pytest.fixture
def client(server, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with tinker.ServiceClient(base_url=server[0], api_key=KEY) as service_client:
        yield service_client


def _raw(url: str, key: str = KEY) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=30)


def _session(http: httpx.Client) -> str:
    return http.post("/api/v1/create_session").json()["session_id"]


def test_sizes_past_the_limits_are_bad_requests(client):
    with pytest.raises(tinker.BadRequestError, match="max_lora_rank"):
        client.create_lora_training_client(base_model="tiny", rank=9).result()
    sampler = client.create_sampling_client(base_model="tiny").result()
    prompt = types.ModelInput.from_ints(PROMPT)
    with pytest.raises(tinker.BadRequestError, match="num_samples"):
        sampler.sample(prompt, 5, types.SamplingParams(max_tokens=2)).result()
    with pytest.raises(tinker.BadRequestError, match="max_tokens"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=17)).result()
    long = types.ModelInput.from_ints(PROMPT * 11)
    with pytest.raises(tinker.BadRequestError, match="over the 64 served"):
        sampler.sample(long, 1, types.SamplingParams(max_tokens=8)).result()
    trainer = client.create_lora_training_client(base_model="tiny", rank=8).result()
    datum = types.Datum(
        model_input=long,
        loss_fn_inputs={"target_tokens": types.TensorData(data=PROMPT * 11, dtype="int64")},
    )
    with pytest.raises(tinker.BadRequestError, match="over the 64 served"):
        trainer.forward([datum], "cross_entropy").result()
    assert (
        len(sampler.sample(prompt, 4, types.SamplingParams(max_tokens=2)).result().sequences) == 4
    )


def test_a_body_past_the_limit_is_refused_while_it_is_read(server):
    url, _ = server
    big = b"x" * (LIMITS.max_body_bytes + 1)
    with _raw(url) as http:
        assert http.post("/api/v1/forward_backward", content=big).status_code == 413

        def stream():  # no Content-Length: the bytes are counted as they come
            for _ in range(200):
                yield b"y" * 1024

        refused = http.post("/api/v1/optim_step", content=stream())
        assert refused.status_code == 413 and "max_body_bytes" in refused.json()["detail"]
        assert http.get("/api/v1/healthz").json() == {"status": "ok"}


def test_training_clients_per_key_are_capped_and_freed_with_their_session(server, monkeypatch):
    url, service = server
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with tinker.ServiceClient(base_url=url, api_key=KEY) as sdk:
        for _ in range(2):
            sdk.create_lora_training_client(base_model="tiny", rank=2).result()
        assert len(service.learners) == 2
        with _raw(url) as http:
            body = {"session_id": _session(http), "model_seq_id": 0, "base_model": "tiny"}
            body["lora_config"] = {"rank": 2}
            refused = http.post("/api/v1/create_model", json=body)
        assert refused.status_code == 429 and "max_training_clients" in refused.text
    assert service.learners == {}  # the session finished: its learners are freed
    with tinker.ServiceClient(base_url=url, api_key=KEY) as sdk:
        trainer = sdk.create_lora_training_client(base_model="tiny", rank=2).result()
        with _raw(url) as http:
            future = http.post("/api/v1/unload_model", json={"model_id": trainer.model_id}).json()
            assert (
                http.post("/api/v1/retrieve_future", json=future).json()["type"] == "unload_model"
            )
        assert service.learners == {}


def test_an_rl_loop_keeps_a_bounded_number_of_samplers_and_copies(client, server):
    _, service = server
    trainer = client.create_lora_training_client(base_model="tiny", rank=2).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    samplers = []
    for _ in range(5):
        sampler = trainer.save_weights_and_get_sampling_client().result()
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1)).result()
        samplers.append(sampler)
    assert len(service.samplers) <= LIMITS.max_samplers
    assert len(service.sampler._models) <= LIMITS.max_sampler_copies
    snapshots = list(service.run_dir.glob("*/ephemeral/*"))
    assert len(snapshots) <= LIMITS.max_samplers
    # the oldest was closed to make room: its use answers as an unknown session
    with pytest.raises(tinker.NotFoundError, match="unknown sampling session"):
        samplers[0].sample(prompt, 1, types.SamplingParams(max_tokens=1)).result()
    assert samplers[-1].sample(prompt, 1, types.SamplingParams(max_tokens=1)).result().sequences


def test_owners_take_turns_queues_are_capped_and_cancel_cancels():
    futures = Futures(max_queued=3)
    gate, order = threading.Event(), []

    def call(name: str):
        def run():
            gate.wait(10)
            order.append(name)

        return run

    try:
        futures.submit("hog", call("hog-0"))
        time.sleep(0.1)  # the worker holds hog-0 until the gate opens
        ids = [futures.submit("hog", call(f"hog-{i}")) for i in (1, 2, 3)]
        with pytest.raises(TooMany, match="max_queued"):
            futures.submit("hog", call("hog-4"))
        futures.submit("other", call("other-0"))
        assert futures.cancel("hog", ids[1]) is True
        with pytest.raises(Exception, match="unknown request_id"):
            futures.cancel("other", ids[0])
        gate.set()
        deadline = time.monotonic() + 10
        while len(order) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        # round robin: the other owner's call runs after one of the hog's, not all of them
        assert order == ["hog-0", "hog-1", "other-0", "hog-3"]
    finally:
        futures.close()


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/api/v1/create_model", {"session_id": "S", "model_seq_id": "0"}),
        (
            "/api/v1/create_model",
            {"session_id": "S", "model_seq_id": 0, "lora_config": {"rank": "8"}},
        ),
        ("/api/v1/create_model", {"session_id": "S", "model_seq_id": 0, "lora_config": [1]}),
        ("/api/v1/create_sampling_session", {"session_id": "S", "model_path": 7}),
        ("/api/v1/weights_info", {"tinker_path": ["a"]}),
    ],
)
def test_wrong_types_are_bad_requests(server, route, body):
    url, _ = server
    with _raw(url) as http:
        body = {k: _session(http) if v == "S" else v for k, v in body.items()}
        answer = http.post(route, json=body)
    assert answer.status_code == 400, answer.text


def test_wrong_types_in_sampling_and_steps_are_bad_requests(client, server):
    url, _ = server
    trainer = client.create_lora_training_client(base_model="tiny", rank=2).result()
    sampler = client.create_sampling_client(base_model="tiny").result()
    prompt = {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]}
    sample = {"sampling_session_id": sampler._sampling_session_id, "prompt": prompt}
    bad = [
        ("/api/v1/optim_step", {"model_id": trainer.model_id, "adam_params": {"beta1": "x"}}),
        ("/api/v1/asample", sample | {"sampling_params": {"max_tokens": "2"}}),
        ("/api/v1/asample", sample | {"sampling_params": {"max_tokens": 2, "temperature": "hot"}}),
        ("/api/v1/asample", sample | {"num_samples": 1.5, "sampling_params": {"max_tokens": 2}}),
        (
            "/api/v1/asample",
            sample | {"prompt": {"chunks": [{"type": "encoded_text", "tokens": ["a"]}]}},
        ),
    ]
    with _raw(url) as http:
        for route, body in bad:
            answer = http.post(route, json=body)
            assert answer.status_code == 400, (route, body, answer.text)


def test_deep_nesting_non_ascii_keys_and_malformed_bodies_are_user_errors(server):
    url, _ = server
    with _raw(url) as http:
        deep = "[" * 20_000 + "]" * 20_000
        nested = http.post("/api/v1/retrieve_future", content=deep)
        assert nested.status_code == 400 and "malformed JSON" in nested.text
        assert http.post("/api/v1/retrieve_future", content=b"\xff\xfe").status_code == 400
    host, port = url.removeprefix("http://").split(":")
    for length in (b"-1", b"12x"):  # a Content-Length httpx would not send
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            head = b"POST /api/v1/optim_step HTTP/1.1\r\nHost: x\r\nX-API-Key: " + KEY.encode()
            sock.sendall(head + b"\r\nContent-Length: " + length + b"\r\n\r\n{}")
            assert sock.recv(1024).startswith(b"HTTP/1.1 400")
    with httpx.Client(base_url=url, timeout=30) as anonymous:
        foreign = {"X-API-Key": "tml-cl\u00e9".encode()}
        assert anonymous.get("/api/v1/healthz", headers=foreign).status_code == 401
    with _raw(url) as http:
        assert http.get("/api/v1/training_runs/caf\u00e9:train:0").status_code == 404
        assert http.get("/api/v1/healthz").json() == {"status": "ok"}


def test_idle_and_slow_connections_are_closed(tmp_path):
    limits = TinkerLimits(idle_timeout_s=0.5, request_timeout_s=0.5)
    with in_thread(TinkerService("tiny", tmp_path, limits=limits)) as url:
        host, port = url.removeprefix("http://").split(":")
        for sent in (b"", b"GET /api/v1/healthz HTTP/1.1\r\nHost: x\r\n"):
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(sent)
                started = time.monotonic()
                assert sock.recv(1024) == b""  # closed by the server, no answer
                assert time.monotonic() - started < 4
        assert httpx.get(f"{url}/api/v1/healthz").status_code == 200
