"""The remote engine against a real OpenAI-compatible server: the session's vLLM server."""

import pytest

from agents.engines.base import BASE, SamplingParams
from agents.engines.openai_http import BadRequestError, ServerError
from agents.engines.remote import RemoteEngine
from agents.engines.vllm_server import free_port

pytestmark = pytest.mark.vllm

QUESTION = [{"role": "user", "content": "Name a colour."}]
SEEDED = SamplingParams(temperature=1.0, max_tokens=12, seed=11)


@pytest.fixture
def remote(vllm_engine):
    engine = RemoteEngine(vllm_engine.base_url, vllm_engine.base_name, api_key="unused")
    yield engine
    engine.close()


@pytest.fixture
def exact(vllm_engine):
    engine = RemoteEngine(vllm_engine.base_url, vllm_engine.base_name, token_ids=True)
    yield engine
    engine.close()


def test_with_token_ids_it_matches_the_vllm_engine(exact, vllm_engine):
    completion = exact.generate(QUESTION, sampling=SEEDED)
    direct = vllm_engine.generate(QUESTION, sampling=SEEDED, adapter=BASE)
    assert exact.token_exact
    assert completion.prompt_token_ids == direct.prompt_token_ids
    assert tuple(exact.encode(QUESTION)) == direct.prompt_token_ids
    assert completion.completion_token_ids == direct.completion_token_ids
    assert completion.completion_logprobs == pytest.approx(direct.completion_logprobs, abs=1e-4)
    ids = (completion.prompt_token_ids, completion.completion_token_ids)
    assert exact.score(*ids) == pytest.approx(vllm_engine.score(*ids), abs=1e-4)
    assert completion.policy_version == exact.policy_version == 0


def test_without_token_ids_the_completion_says_so_with_empty_ids(remote):
    completion = remote.generate(QUESTION, sampling=SEEDED)
    assert not remote.token_exact
    assert completion.prompt_token_ids == () and completion.completion_token_ids == ()
    assert len(completion.completion_logprobs) == completion.usage["completion_tokens"] == 12
    assert completion.message["role"] == "assistant" and completion.message["content"]
    assert completion.finish_reason == "length"


def test_stream_ends_with_the_whole_completion(exact):
    *chunks, final = exact.stream(QUESTION, sampling=SEEDED)
    assert tuple(i for c in chunks for i in c.token_ids) == final.completion_token_ids
    assert len(final.completion_token_ids) == 12
    assert (
        final.completion_token_ids == exact.generate(QUESTION, sampling=SEEDED).completion_token_ids
    )


def test_what_it_cannot_do_is_a_clear_error(remote, vllm_engine):
    with pytest.raises(NotImplementedError, match="cannot load adapters"):
        remote.load_adapter("/some/adapter", version=1)
    with pytest.raises(ValueError, match="unknown adapter"):
        remote.generate(QUESTION, adapter="other")
    wrong = RemoteEngine(vllm_engine.base_url, "no-such-model")
    with pytest.raises(BadRequestError, match="404"):
        wrong.generate(QUESTION, sampling=SEEDED)
    closed = RemoteEngine(f"http://127.0.0.1:{free_port()}/v1", "x")
    with pytest.raises(ServerError, match="cannot reach"):
        closed.generate(QUESTION)
