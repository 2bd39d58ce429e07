"""clawgym's Tinker server with its sampling clients on vLLM (`engine=vllm`): the real `tinker`
SDK takes a LoRA step on the learner, and the checkpoint it saves for sampling is sampled and
scored by the session's vLLM server (tiny model), agreeing with the learner's log-probs."""

import numpy as np
import pytest
import tinker
from tinker import types

from tests.agents.engines.test_vllm import loaded_loras
from trainers.tinker.app import in_thread
from trainers.tinker.samplers import VLLMSampler
from trainers.tinker.service import TinkerService

pytestmark = pytest.mark.vllm

PROMPT = [1, 5, 9, 200, 31, 7]
COMPLETION = [44, 45, 46, 47, 12]


@pytest.fixture
def service(vllm_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    sampler = VLLMSampler(vllm_engine, max_lora_rank=16)
    with in_thread(TinkerService("tiny", tmp_path / "tinker", sampler)) as url:
        with tinker.ServiceClient(base_url=url, api_key="tml-vllm") as client:
            yield client
    # the session's vLLM server outlives the test: it is left serving what it served before
    sampler.release()
    assert not [name for name in loaded_loras(vllm_engine) if name.startswith("tinker-")]


def _datum(advantage: float, logprobs: list[float]) -> types.Datum:
    tokens = PROMPT + COMPLETION
    shift = len(PROMPT) - 1
    inputs = {
        "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
        "logprobs": np.asarray([0.0] * shift + logprobs, dtype=np.float32),
        "advantages": np.asarray([0.0] * shift + [advantage] * len(COMPLETION), np.float32),
    }
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={k: types.TensorData.from_numpy(v) for k, v in inputs.items()},
    )


def _learner_logprobs(trainer, datum: types.Datum) -> list[float]:
    output = trainer.forward([datum], "importance_sampling").result().loss_fn_outputs[0]
    return output["logprobs"].tolist()[-len(COMPLETION) :]


def _scored(sampler) -> list[float]:
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT + COMPLETION)).result()
    return scored[len(PROMPT) :]


def test_vllm_samples_the_trained_checkpoint_with_the_learner_logprobs(service):
    trainer = service.create_lora_training_client(base_model="tiny", rank=4).result()
    base = service.create_sampling_client(base_model="tiny").result()
    old = _scored(base)
    assert _learner_logprobs(trainer, _datum(1.0, old)) == pytest.approx(old, abs=1e-3)

    trainer.forward_backward([_datum(1.0, old)], "importance_sampling").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = trainer.save_weights_and_get_sampling_client().result()
    new = _scored(after)
    assert sum(new) > sum(old) + 0.5  # vLLM serves the stepped adapter, not the base model
    assert new == pytest.approx(_learner_logprobs(trainer, _datum(1.0, old)), abs=1e-3)

    prompt = types.ModelInput.from_ints(PROMPT)
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=5)
    first = after.sample(prompt, 3, params).result().sequences
    assert [len(s.tokens) for s in first] == [5, 5, 5]
    again = after.sample(prompt, 3, params).result().sequences
    assert [s.tokens for s in again] == [s.tokens for s in first]  # seeded: repeatable
    assert len({tuple(s.tokens) for s in first}) > 1  # three different draws, not one
    for sequence in first:
        rescored = after.compute_logprobs(types.ModelInput.from_ints(PROMPT + sequence.tokens))
        assert rescored.result()[len(PROMPT) :] == pytest.approx(sequence.logprobs, abs=1e-3)

    greedy = types.SamplingParams(max_tokens=5, temperature=0.0, stop=[first[0].tokens[0]])
    stopped = after.sample(prompt, 1, greedy).result().sequences[0]
    assert stopped.stop_reason == "length" or stopped.tokens[-1] == first[0].tokens[0]


def test_a_sampler_checkpoint_saved_again_is_sampled_anew(service):
    trainer = service.create_lora_training_client(base_model="tiny", rank=4).result()
    path = trainer.save_weights_for_sampler("latest").result().path
    before = _scored(service.create_sampling_client(model_path=path).result())
    trainer.forward_backward([_datum(1.0, before)], "importance_sampling").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert trainer.save_weights_for_sampler("latest").result().path == path
    again = _scored(service.create_sampling_client(model_path=path).result())
    assert sum(again) > sum(before) + 0.5


def test_a_rank_past_vllm_slots_fails_the_sample_and_the_server_stays_up(service):
    trainer = service.create_lora_training_client(base_model="tiny", rank=32).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.RequestFailedError, match="rank 32 is above .* max_lora_rank 16"):
        sampler.sample(
            types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2)
        ).result()
    base = service.create_sampling_client(base_model="tiny").result()
    assert len(_scored(base)) == len(COMPLETION)
