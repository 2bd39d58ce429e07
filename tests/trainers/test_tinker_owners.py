"""Two API keys on one Tinker server (tiny model, loopback, the real `tinker` SDK): each key
sees only what it made, ids are the server's, and names map to disk one-to-one (#41)."""

import json

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from trainers.tinker.app import in_thread
from trainers.tinker.service import TinkerService

ALICE, BOB = "tml-alice", "tml-bob"
PROMPT = [1, 5, 9, 200, 31, 7]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tinker-owners")
    with in_thread(TinkerService("tiny", run_dir), api_key=[ALICE, BOB]) as url:
        yield url, run_dir


@pytest.fixture
def clients(server, monkeypatch):
    """(alice's ServiceClient, bob's ServiceClient, url)."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    url, _ = server
    with (
        tinker.ServiceClient(base_url=url, api_key=ALICE) as alice,
        tinker.ServiceClient(base_url=url, api_key=BOB) as bob,
    ):
        yield alice, bob, url


def _raw(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=30)


def _datum() -> types.Datum:
    tokens = np.asarray(PROMPT[1:] + [2], dtype=np.int64)
    return types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT),
        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(tokens)},
    )


def test_another_keys_runs_checkpoints_and_futures_read_as_missing(clients):
    alice, bob, url = clients
    trainer = alice.create_lora_training_client(base_model="tiny", rank=4).result()
    saved = trainer.save_state("mine").result().path
    alice_rest = tinker.RestClient(base_url=url, api_key=ALICE)
    bob_rest = tinker.RestClient(base_url=url, api_key=BOB)
    with pytest.raises(tinker.NotFoundError, match="no training run"):
        bob_rest.get_training_run(trainer.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        bob_rest.list_checkpoints(trainer.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        bob_rest.delete_checkpoint(trainer.model_id, "weights/mine").result()
    with pytest.raises(tinker.NotFoundError):
        bob_rest.get_weights_info_by_tinker_path(saved).result()
    ids = [r.training_run_id for r in bob_rest.list_training_runs(limit=100).result().training_runs]
    assert trainer.model_id not in ids
    # a foreign checkpoint answers as a missing one: its existence does not leak
    with pytest.raises(tinker.BadRequestError, match="no checkpoint"):
        bob.create_sampling_client(model_path=saved).result()
    with pytest.raises(tinker.RequestFailedError, match="no checkpoint"):
        bob.create_training_client_from_state(saved).result()
    listed = alice_rest.list_checkpoints(trainer.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [saved]
    assert trainer.forward([_datum()], "cross_entropy").result().metrics["loss:sum"] > 0


def test_another_key_cannot_use_or_replace_a_live_training_client(clients):
    alice, _, url = clients
    trainer = alice.create_lora_training_client(base_model="tiny", rank=4).result()
    session = trainer.model_id.split(":")[0]
    with _raw(url, BOB) as bob, _raw(url, ALICE) as mine:
        step = {"model_id": trainer.model_id, "adam_params": {"learning_rate": 1.0}}
        assert bob.post("/api/v1/optim_step", json=step).status_code == 404
        assert bob.post("/api/v1/get_info", json={"model_id": trainer.model_id}).status_code == 404
        assert (
            bob.post("/api/v1/unload_model", json={"model_id": trainer.model_id}).status_code == 404
        )
        # a new model in alice's session, or one under her model id, is refused too
        body = {"session_id": session, "model_seq_id": 0, "base_model": "tiny"}
        assert bob.post("/api/v1/create_model", json=body).status_code == 404
        load = {"session_id": session, "model_seq_id": 0, "path": "tinker://x:train:0/weights/a"}
        assert bob.post("/api/v1/load_weights", json=load).status_code == 404
        # her own future is hers only
        future = mine.post("/api/v1/get_info", json={"model_id": trainer.model_id})
        assert future.status_code == 200
        step_future = mine.post("/api/v1/optim_step", json=step | {"adam_params": {}}).json()
        request_id = step_future["request_id"]
        assert (
            bob.post("/api/v1/retrieve_future", json={"request_id": request_id}).status_code == 404
        )
        assert bob.post("/api/v1/cancel_future", json={"request_id": request_id}).status_code == 404
        assert "metrics" in mine.post("/api/v1/retrieve_future", json=step_future).json()
    assert trainer.get_info().lora_rank == 4


def test_future_and_session_ids_are_unguessable(server):
    url, _ = server
    with _raw(url, ALICE) as client:
        sessions = [client.post("/api/v1/create_session").json()["session_id"] for _ in range(2)]
        model = {"session_id": sessions[0], "model_seq_id": 0, "base_model": "no-such"}
        futures = [
            client.post("/api/v1/create_model", json=model | {"model_seq_id": i}).json()
            for i in range(2)
        ]
    assert sessions[0] != sessions[1] and all(len(s) >= 32 for s in sessions)
    ids = [f["request_id"] for f in futures]
    assert ids[0] != ids[1] and all(len(i.removeprefix("req-")) >= 22 for i in ids)
    assert not any(i.removeprefix("req-").isdigit() for i in ids)


def test_odd_names_never_reach_the_disk_or_break_listing(clients, server):
    alice, _, url = clients
    _, run_dir = server
    # folders a hand, an older server or an attacker left: listing skips them
    (run_dir / "odd").mkdir()
    (run_dir / "odd" / "run.json").write_text(json.dumps({"model_id": "../../etc"}))
    (run_dir / "broken_train_1").mkdir()
    (run_dir / "broken_train_1" / "run.json").write_text("{not json")
    trainer = alice.create_lora_training_client(base_model="tiny", rank=4).result()
    for name in ("../up", ".hidden", "a/b", "naïve", "x" * 129):
        with pytest.raises(tinker.BadRequestError, match="bad checkpoint name"):
            trainer.save_state(name).result()
    # a name that looks like a staging folder is only a name: both checkpoints are kept
    first = trainer.save_state("step").result().path
    second = trainer.save_state("step.tmp").result().path
    rest = tinker.RestClient(base_url=url, api_key=ALICE)
    listed = {c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result().checkpoints}
    assert listed == {first, second}
    runs = rest.list_training_runs(limit=100).result().training_runs
    assert trainer.model_id in [r.training_run_id for r in runs]
    with _raw(url, ALICE) as client:
        for odd in ("caf\u00e9:train:0", "a_b:train:0", "x:train:-1"):
            assert client.get(f"/api/v1/training_runs/{odd}").status_code == 404
    assert not list(run_dir.glob("*/staging/*"))


def test_a_restarted_server_keeps_each_keys_runs_its_own(clients, server, tmp_path):
    alice, _, url = clients
    _, run_dir = server
    trainer = alice.create_lora_training_client(base_model="tiny", rank=4).result()
    saved = trainer.save_state("kept").result().path
    with in_thread(TinkerService("tiny", run_dir), api_key=[ALICE, BOB]) as restarted:
        mine = tinker.RestClient(base_url=restarted, api_key=ALICE)
        theirs = tinker.RestClient(base_url=restarted, api_key=BOB)
        assert mine.get_training_run(trainer.model_id).result().last_checkpoint.tinker_path == saved
        with pytest.raises(tinker.NotFoundError):
            theirs.get_training_run(trainer.model_id).result()


def test_keys_that_name_one_user_share_that_users_runs(tmp_path, monkeypatch):
    """`USER KEY` entries (`agents.api_keys`): a user's runs are theirs with any of their keys
    (a key being rotated), and a run records the user, never a key."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    keys = ["alice tml-alice-old", "alice tml-alice-new", BOB]
    with (
        in_thread(TinkerService("tiny", tmp_path), api_key=keys) as url,
        tinker.ServiceClient(base_url=url, api_key="tml-alice-old") as old,
    ):
        trainer = old.create_lora_training_client(base_model="tiny", rank=4).result()
        saved = trainer.save_state("rotated").result().path
        new = tinker.RestClient(base_url=url, api_key="tml-alice-new")
        run = new.get_training_run(trainer.model_id).result()
        assert run.model_owner == "alice" and run.last_checkpoint.tinker_path == saved
        with pytest.raises(tinker.NotFoundError):
            tinker.RestClient(base_url=url, api_key=BOB).get_training_run(trainer.model_id).result()
    records = "".join(p.read_text() for p in tmp_path.glob("*/run.json"))
    assert '"owner": "alice"' in records and "tml-alice" not in records
