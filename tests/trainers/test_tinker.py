"""The real `tinker` SDK against clawgym's Tinker server on the tiny model, over loopback."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tinker
from tinker import types

from tests.trainers.test_learner import openmp_thread_counts
from trainers.tinker.app import build_app, in_thread
from trainers.tinker.service import TinkerService
from trainers.tinker.wire import Datum

PROMPT = [1, 5, 9, 200, 31, 7]
COMPLETION = [44, 45, 46, 47, 12]


def _inputs(**values: list) -> dict[str, types.TensorData]:
    """Loss inputs as the SDK types them: token ids int64, the rest float32."""
    return {
        name: types.TensorData.from_numpy(
            np.asarray(row, dtype=np.int64 if name == "target_tokens" else np.float32)
        )
        for name, row in values.items()
    }


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    with in_thread(TinkerService("tiny", tmp_path_factory.mktemp("tinker-run"))) as url:
        yield url


@pytest.fixture
def service(base_url, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    # closed after the test: its session's heartbeats stop before the server does
    with tinker.ServiceClient(base_url=base_url, api_key="tml-loopback") as client:
        yield client


def _rewarded(logprobs: list[float]):
    """Predict each next token; advantage 1 on the completion, 0 on the prompt."""
    tokens = PROMPT + COMPLETION
    shift = len(PROMPT) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs=_inputs(
            target_tokens=tokens[1:],
            logprobs=[0.0] * shift + logprobs,
            advantages=[0.0] * shift + [1.0] * len(COMPLETION),
        ),
    )


def _completion_logprob(sampler) -> float:
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT + COMPLETION)).result()
    return sum(scored[len(PROMPT) :])


def test_importance_sampling_step_raises_the_rewarded_logprob(service, base_url):
    rest = tinker.RestClient(base_url=base_url, api_key="tml-loopback")
    models = rest.get_server_capabilities().result().supported_models
    assert [m.model_name for m in models] == ["tiny"]
    trainer = service.create_lora_training_client(base_model="tiny", rank=4).result()
    before = trainer.save_weights_and_get_sampling_client().result()
    sampled = before.sample(
        types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=3, seed=3)
    ).result()
    assert [len(s.tokens) for s in sampled.sequences] == [3, 3]
    assert all(lp <= 0 for s in sampled.sequences for lp in s.logprobs)
    scored = before.compute_logprobs(types.ModelInput.from_ints(PROMPT + COMPLETION)).result()
    old = scored[len(PROMPT) :]

    output = trainer.forward_backward([_rewarded(old)], "importance_sampling").result()
    # on-policy, the ratio is 1: the loss is minus the summed advantages
    assert output.metrics["loss:sum"] == pytest.approx(-len(COMPLETION), abs=1e-3)
    assert output.loss_fn_outputs[0]["logprobs"].tolist()[-len(COMPLETION) :] == pytest.approx(
        old, abs=1e-4
    )
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = trainer.save_weights_and_get_sampling_client().result()
    assert _completion_logprob(after) > sum(old) + 0.5
    assert _completion_logprob(before) == pytest.approx(sum(old), abs=1e-4)


def test_sampled_logprobs_are_the_scored_logprobs(service):
    sampler = service.create_sampling_client(base_model="tiny").result()
    prompt = types.ModelInput.from_ints(PROMPT)
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=7)
    sequence = sampler.sample(prompt, 1, params).result().sequences[0]
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT + sequence.tokens))
    assert scored.result()[len(PROMPT) :] == pytest.approx(sequence.logprobs, abs=1e-4)
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[sequence.tokens[0]])
    stopped = sampler.sample(prompt, 1, greedy).result().sequences[0]
    assert stopped.stop_reason in ("stop", "length")
    assert stopped.stop_reason == "length" or stopped.tokens[-1] == sequence.tokens[0]


def test_saved_state_resumes_in_a_new_training_client(service):
    trainer = service.create_lora_training_client(base_model="tiny", rank=4, train_mlp=False)
    trainer = trainer.result()
    datum = _rewarded([-5.0] * len(COMPLETION))
    trainer.forward_backward([datum], "importance_sampling").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    saved = trainer.save_state("after-one-step").result().path
    assert saved.startswith("tinker://") and saved.endswith("/weights/after-one-step")
    resumed = service.create_training_client_from_state_with_optimizer(saved).result()
    mine = trainer.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    theirs = resumed.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    assert theirs.tolist() == pytest.approx(mine.tolist(), abs=1e-5)
    sampler = service.create_sampling_client(model_path=saved).result()
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT + COMPLETION)).result()
    assert scored[len(PROMPT) :] == pytest.approx(mine.tolist()[-len(COMPLETION) :], abs=1e-4)


def test_cross_entropy_ppo_cispo_and_dro_losses(service):
    trainer = service.create_lora_training_client(base_model="tiny", rank=4).result()
    tokens = PROMPT + COMPLETION
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs=_inputs(target_tokens=tokens[1:], weights=[1.0] * (len(tokens) - 1)),
    )
    output = trainer.forward_backward([datum], "cross_entropy").result()
    logprobs = output.loss_fn_outputs[0]["logprobs"].tolist()
    assert output.metrics["loss:sum"] == pytest.approx(-sum(logprobs), rel=1e-4)
    shorter = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs=_inputs(target_tokens=PROMPT[1:]),
    )
    alone = trainer.forward([shorter], "cross_entropy").result().loss_fn_outputs[0]
    # one padded batch: each datum's log-probs as if it were alone
    both = trainer.forward([datum, shorter], "cross_entropy").result().loss_fn_outputs
    assert both[0]["logprobs"].tolist() == pytest.approx(logprobs, abs=1e-4)
    assert both[1]["logprobs"].tolist() == pytest.approx(alone["logprobs"].tolist(), abs=1e-4)
    # sampled at far lower log-probs: the ratio is far above 1.2, so PPO clips it there
    stale = types.Datum(
        model_input=datum.model_input,
        loss_fn_inputs=_inputs(
            target_tokens=tokens[1:],
            logprobs=[lp - 5.0 for lp in logprobs],
            advantages=[1.0] * len(logprobs),
        ),
    )
    ppo = trainer.forward_backward([stale], "ppo").result()
    assert ppo.metrics["loss:sum"] == pytest.approx(-1.2 * len(logprobs), rel=1e-4)
    # CISPO: the ratio e^5 clipped to its default 4, a coefficient on logp
    cispo = trainer.forward_backward([stale], "cispo").result()
    assert cispo.metrics["loss:sum"] == pytest.approx(-4.0 * sum(logprobs), rel=1e-4)
    # DRO: logp * A less beta / 2 * 5^2 a token
    dro = trainer.forward_backward([stale], "dro", {"beta": 0.1}).result()
    penalty = 0.5 * 0.1 * 25.0 * len(logprobs)
    assert dro.metrics["loss:sum"] == pytest.approx(-sum(logprobs) + penalty, rel=1e-4)


def test_bad_input_fails_its_future_and_the_server_stays_up(service):
    with pytest.raises(tinker.RequestFailedError, match="unknown base model"):
        service.create_lora_training_client(base_model="no-such-model", rank=4).result()
    trainer = service.create_lora_training_client(base_model="tiny", rank=4).result()
    short = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT),
        loss_fn_inputs=_inputs(target_tokens=PROMPT[1:]),
    )
    with pytest.raises(tinker.RequestFailedError, match="shape"):
        trainer.forward_backward([short], "cross_entropy").result()
    ok = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT),
        loss_fn_inputs=_inputs(target_tokens=PROMPT[1:] + [2]),
    )
    with pytest.raises(tinker.RequestFailedError, match="needs loss_fn_inputs"):
        trainer.forward_backward([ok], "ppo").result()
    with pytest.raises(tinker.RequestFailedError, match="unknown loss_fn 'reinforce'"):
        trainer.forward_backward([ok], "reinforce").result()
    with pytest.raises(tinker.RequestFailedError, match="takes no loss_fn_config 'clip'"):
        trainer.forward_backward([ok], "cross_entropy", {"clip": 1.0}).result()
    other = service.create_lora_training_client(base_model="tiny", rank=2).result()
    saved = other.save_state("rank-two").result().path
    # load_state is deprecated in the SDK but still served
    with pytest.warns(FutureWarning), pytest.raises(tinker.RequestFailedError, match="differs"):
        trainer.load_state(saved).result()
    assert trainer.forward_backward([ok], "cross_entropy").result().metrics["loss:sum"] > 0


def test_rest_client_lists_runs_and_checkpoints_and_deletes_one(service, base_url):
    trainer = service.create_lora_training_client(base_model="tiny", rank=4).result()
    state = trainer.save_state("first").result().path
    for_sampling = trainer.save_weights_for_sampler("for-sampling").result().path
    rest = tinker.RestClient(base_url=base_url, api_key="tml-loopback")
    run = rest.get_training_run(trainer.model_id).result()
    assert (run.training_run_id, run.base_model, run.lora_rank) == (trainer.model_id, "tiny", 4)
    assert run.last_checkpoint.tinker_path == state
    assert run.last_sampler_checkpoint.tinker_path == for_sampling
    listed = rest.list_checkpoints(trainer.model_id).result().checkpoints
    assert {(c.tinker_path, c.checkpoint_type) for c in listed} == {
        (state, "training"),
        (for_sampling, "sampler"),
    }
    assert all(c.size_bytes > 0 for c in listed)
    runs = rest.list_training_runs(limit=100).result()
    assert trainer.model_id in [r.training_run_id for r in runs.training_runs]
    assert runs.cursor.total_count == len(runs.training_runs)
    info = rest.get_weights_info_by_tinker_path(state).result()
    shape = (info.base_model, info.lora_rank, info.train_mlp, info.is_lora)
    assert shape == ("tiny", 4, True, True)

    rest.delete_checkpoint_from_tinker_path(for_sampling).result()
    listed = rest.list_checkpoints(trainer.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [state]
    with pytest.raises(tinker.BadRequestError, match="no checkpoint"):
        service.create_sampling_client(model_path=for_sampling).result()
    with pytest.raises(tinker.NotFoundError, match="no training run"):
        rest.get_training_run("nobody:train:0").result()
    with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
        rest.delete_checkpoint(trainer.model_id, "weights/never-saved").result()


def test_unknown_checkpoint_is_a_bad_request(service):
    with pytest.raises(tinker.BadRequestError, match="no checkpoint"):
        service.create_sampling_client(model_path="tinker://nobody/weights/nothing").result()
    with pytest.raises(tinker.BadRequestError, match="not a tinker://"):
        service.create_sampling_client(model_path="tinker://a/../../etc").result()


def test_api_key_is_required_when_set(tmp_path):
    from fastapi.testclient import TestClient

    client = TestClient(build_app(TinkerService("tiny", tmp_path), api_key="tml-secret"))
    assert client.get("/api/v1/healthz").status_code == 401
    wrong = client.get("/api/v1/healthz", headers={"X-API-Key": "tml-other"})
    assert wrong.status_code == 401
    right = client.get("/api/v1/healthz", headers={"X-API-Key": "tml-secret"})
    assert right.json() == {"status": "ok"}


def test_malformed_protobuf_fails_its_future_as_a_user_error(tmp_path):
    from fastapi.testclient import TestClient

    client = TestClient(build_app(TinkerService("tiny", tmp_path)))
    headers = {"Content-Type": "application/x-protobuf"}
    future = client.post("/api/v1/forward_backward", content=b"\xff\x00junk", headers=headers)
    answer = client.post("/api/v1/retrieve_future", json=future.json()).json()
    assert answer["category"] == "user" and "malformed" in answer["error"]
    assert client.get("/api/v1/healthz").json() == {"status": "ok"}


def test_the_server_refuses_a_bind_beyond_loopback_without_a_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CLAWGYM_TINKER_API_KEY"}
    command = [sys.executable, "-m", "trainers.tinker", "tinker.host=0.0.0.0", "model=tiny"]
    refused = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode != 0
    assert "tinker.host=0.0.0.0 is not loopback: set tinker.api_key" in refused.stderr


def test_the_server_section_takes_a_known_device_and_a_key_from_the_environment(monkeypatch):
    from trainers.tinker.__main__ import TinkerSection, checked_section

    monkeypatch.setenv("CLAWGYM_TINKER_API_KEY", "tml-env")
    assert checked_section(TinkerSection(host="0.0.0.0")).api_key == "tml-env"
    with pytest.raises(ValueError, match="tinker.device must be auto, cpu or cuda"):
        checked_section(TinkerSection(device="tpu"))
    with pytest.raises(ValueError, match="tinker.dtype"):
        checked_section(TinkerSection(dtype="float16"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_training_calls_leave_no_openmp_workers_on_their_worker_thread(tmp_path):
    """forward_backward and optim_step run on the server's long-lived worker threads beside
    the sampler's engine: each lets its thread's OpenMP workers go when it returns."""
    service = TinkerService("tiny", tmp_path)
    model = "threads:train:0"
    service.create_model(model, "tiny", rank=4)
    tokens = PROMPT + COMPLETION
    datum = Datum(
        tuple(tokens[:-1]),
        {
            "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
            "weights": np.ones(len(tokens) - 1, dtype=np.float32),
        },
    )
    try:
        counts = openmp_thread_counts(
            {
                "after forward_backward": lambda: service.forward_backward(
                    model, "cross_entropy", {}, (datum,), False
                ),
                "after optim_step": lambda: service.optim_step(model, {"learning_rate": 1e-3}),
            }
        )
    finally:
        service.close()
    assert counts["after forward_backward"] == counts["after optim_step"] == counts["before"]
