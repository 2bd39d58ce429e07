import pytest
import torch
from peft import LoraConfig, get_peft_model

from agents import models
from agents.engines.base import BASE, POLICY, SamplingParams
from agents.engines.embedded import EmbeddedEngine

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def test_completion_is_token_exact_and_rescores_to_the_same_logprobs(tiny_engine):
    completion = tiny_engine.generate(
        MESSAGES, sampling=SamplingParams(temperature=1.0, max_tokens=24, seed=1)
    )
    assert list(completion.prompt_token_ids) == tiny_engine.encode(MESSAGES)
    assert len(completion.completion_logprobs) == len(completion.completion_token_ids) > 0
    assert all(lp <= 0.0 for lp in completion.completion_logprobs)
    rescored = tiny_engine.score(
        completion.prompt_token_ids, completion.completion_token_ids, adapter=BASE
    )
    assert rescored == pytest.approx(list(completion.completion_logprobs), abs=1e-4)
    assert completion.usage == {
        "prompt_tokens": len(completion.prompt_token_ids),
        "completion_tokens": len(completion.completion_token_ids),
    }


def test_seeded_sampling_repeats_and_length_limit_is_reported(tiny_engine):
    sampling = SamplingParams(temperature=0.9, top_p=0.8, max_tokens=8, seed=7)
    first, second = (tiny_engine.generate(MESSAGES, sampling=sampling) for _ in range(2))
    assert first.completion_token_ids == second.completion_token_ids
    assert len(first.completion_token_ids) <= 8
    if len(first.completion_token_ids) == 8 and first.finish_reason != "tool_calls":
        assert first.finish_reason == "length"


def test_stop_string_ends_the_completion_and_is_not_returned(tiny_engine):
    greedy = tiny_engine.generate(MESSAGES, sampling=SamplingParams(temperature=0.0, max_tokens=6))
    stop = tiny_engine.tokenizer.decode(greedy.completion_token_ids[2:3])
    assert stop.strip(), "the random model's greedy output should hold a visible token"
    stopped = tiny_engine.generate(
        MESSAGES, sampling=SamplingParams(temperature=0.0, max_tokens=6, stop=(stop,))
    )
    assert stopped.finish_reason == "stop"
    assert (
        stopped.completion_token_ids
        == greedy.completion_token_ids[: len(stopped.completion_token_ids)]
    )
    assert stop not in (stopped.message["content"] or "")


def test_bad_sampling_values_are_refused():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def save_random_adapter(path, seed):
    model, _ = models.load("tiny")
    torch.manual_seed(seed)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(path)
    return path


def test_adapter_versions_swap_and_base_stays_reachable(tmp_path):
    engine = EmbeddedEngine("tiny")
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    before = engine.generate(MESSAGES, sampling=greedy)
    assert (before.policy_version, engine.policy_version) == (0, 0)

    engine.load_adapter(str(save_random_adapter(tmp_path / "v1", seed=1)), version=1)
    policy = engine.generate(MESSAGES, sampling=greedy, adapter=POLICY)
    base = engine.generate(MESSAGES, sampling=greedy, adapter=BASE)
    assert policy.policy_version == 1 and base.policy_version == 0
    assert base.completion_token_ids == before.completion_token_ids
    assert base.completion_logprobs == pytest.approx(before.completion_logprobs, abs=1e-5)
    ids = (before.prompt_token_ids, before.completion_token_ids)
    assert engine.score(*ids, adapter=POLICY) != pytest.approx(
        engine.score(*ids, adapter=BASE), abs=1e-3
    )

    engine.load_adapter(str(save_random_adapter(tmp_path / "v2", seed=2)), version=2)
    assert engine.generate(MESSAGES, sampling=greedy).policy_version == 2
    # Versions after the first reuse preallocated slots: peft's adapters do not pile up.
    assert len(engine._peft.peft_config) == 3
    with pytest.raises(ValueError, match="unknown adapter"):
        engine.generate(MESSAGES, adapter="nope")


def test_stream_yields_every_token_then_the_same_completion(tiny_engine):
    sampling = SamplingParams(temperature=1.0, max_tokens=16, seed=3)
    *chunks, final = tiny_engine.stream(MESSAGES, sampling=sampling)
    assert final == tiny_engine.generate(MESSAGES, sampling=sampling)
    assert tuple(i for c in chunks for i in c.token_ids) == final.completion_token_ids
    assert tuple(lp for c in chunks for lp in c.logprobs) == final.completion_logprobs
    assert "".join(c.text for c in chunks) == tiny_engine.tokenizer.decode(
        final.completion_token_ids
    )


@pytest.mark.parametrize(
    "text",
    [
        "  leading spaces\nand newlines\n\n- a bullet",
        "Émigré naïve café 日本語のテキスト 🙂👍🏽 done",
        "def f(x):\n    return x**2  # why",
    ],
)
def test_text_deltas_add_up_to_the_decoded_text(tiny_engine, text):
    from agents.engines.embedded import _Detokenizer

    tokenizer = tiny_engine.tokenizer
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    deltas = _Detokenizer(tokenizer)
    shown = []
    for end, token in enumerate(ids, start=1):
        shown.append(deltas.push(token))
        assert tokenizer.decode(ids[:end]).startswith("".join(shown))  # never ahead
    assert "".join(shown) == tokenizer.decode(ids) == text
