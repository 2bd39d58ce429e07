"""The Tinker engine with the real `tinker` SDK against clawgym's Tinker server (tiny model,
in this process on a loopback port): token-exact completions, scores, publishing."""

import asyncio
import json

import pytest
import tinker

from agents import models
from agents.engines.base import BASE, Completion, ContextExceeded, SamplingParams
from agents.engines.tinker import TINKER_POINTER, TinkerEngine
from trainers.tinker.app import in_thread
from trainers.tinker.service import TinkerService

CHAT = [{"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    server_engine = TinkerService("tiny", tmp_path_factory.mktemp("tinker-server"))
    with in_thread(server_engine) as url, pytest.MonkeyPatch.context() as patch:
        patch.setenv("TINKER_TELEMETRY", "0")
        with tinker.ServiceClient(base_url=url, api_key="tml-x") as client:
            yield client


@pytest.fixture(scope="module")
def engine(service):
    return TinkerEngine(service, "tiny", models.load_tokenizer("tiny"), context_length=256)


def test_a_completion_is_token_exact_and_scored_alike(engine):
    sampling = SamplingParams(temperature=1.0, max_tokens=6, seed=3)
    completion = engine.generate(CHAT, sampling=sampling)
    assert completion.prompt_token_ids == tuple(engine.encode(CHAT))
    assert 1 <= len(completion.completion_token_ids) == len(completion.completion_logprobs) <= 6
    assert completion.policy_version == 0 and completion.finish_reason in ("stop", "length")
    scored = engine.score(completion.prompt_token_ids, completion.completion_token_ids, BASE)
    assert scored == pytest.approx(list(completion.completion_logprobs), abs=1e-4)


def test_astream_ends_with_the_completion_its_chunks_carry(engine):
    async def collect():
        return [item async for item in engine.astream(CHAT, sampling=SamplingParams(seed=1))]

    *chunks, completion = asyncio.run(collect())
    assert isinstance(completion, Completion)
    assert sum((c.token_ids for c in chunks), ()) == completion.completion_token_ids


def test_a_published_checkpoint_becomes_the_policy(engine, service, tmp_path):
    trainer = service.create_lora_training_client(base_model="tiny", rank=2).result()
    saved = trainer.save_weights_for_sampler(name="published").result().path
    (tmp_path / TINKER_POINTER).write_text(json.dumps({"model_path": saved}))
    engine.load_adapter(str(tmp_path), 5)
    assert engine.policy_version == 5
    assert engine.generate(CHAT, sampling=SamplingParams(max_tokens=2)).policy_version == 5
    assert engine.generate(CHAT, adapter=BASE).policy_version == 0
    with pytest.raises(ValueError, match="unknown adapter"):
        engine.score([1, 2], [3], adapter="other")


def test_a_prompt_past_the_context_is_refused(engine):
    long = [{"role": "user", "content": "word " * 400}]
    with pytest.raises(ContextExceeded, match="shorten"):
        engine.generate(long)
