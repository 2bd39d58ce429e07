import dataclasses
import random
import unicodedata

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers import models as tokenizer_models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from agents import models
from agents.engines.base import BASE, POLICY, SamplingParams
from agents.engines.char_bound import NORMALIZER_SHRINK, CharBound, char_bound, request_chars
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
    # seed 3's 16 tokens end inside a multi-byte character: the stream's last chunk carries
    # the text held back for it, as the completion's text has it
    sampling = SamplingParams(temperature=1.0, max_tokens=16, seed=3)
    *chunks, final = tiny_engine.stream(MESSAGES, sampling=sampling)
    again = tiny_engine.generate(MESSAGES, sampling=sampling)
    # the repeat reuses the stream's KV (the prefix cache): its log-probs agree to rounding
    assert dataclasses.replace(again, completion_logprobs=final.completion_logprobs) == final
    assert again.completion_logprobs == pytest.approx(final.completion_logprobs, abs=1e-5)
    assert tuple(i for c in chunks for i in c.token_ids) == final.completion_token_ids
    assert tuple(lp for c in chunks for lp in c.logprobs) == final.completion_logprobs
    assert "".join(c.text for c in chunks) == tiny_engine.tokenizer.decode(
        final.completion_token_ids
    )


def test_a_streamed_reply_that_ends_at_eos_has_no_eos_text(tiny_engine):
    # seed 18 makes `tiny` sample its end-of-sequence token within 64 tokens (at its 39th)
    sampling = SamplingParams(temperature=1.0, max_tokens=64, seed=18)
    *chunks, final = tiny_engine.stream(MESSAGES, sampling=sampling)
    assert final.finish_reason == "stop" and final.completion_token_ids[-1] in (
        tiny_engine._eos_ids()
    )
    assert chunks[-1].text == "" and "<|im_end|>" not in "".join(c.text for c in chunks)
    assert "".join(c.text for c in chunks) == tiny_engine.tokenizer.decode(
        final.completion_token_ids[:-1]
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
    from agents.engines.detokenize import Detokenizer

    tokenizer = tiny_engine.tokenizer
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    deltas = Detokenizer(tokenizer)
    shown = []
    for end, token in enumerate(ids, start=1):
        shown.append(deltas.push(token))
        assert tokenizer.decode(ids[:end]).startswith("".join(shown))  # never ahead
    assert "".join(shown) == tokenizer.decode(ids) == text


# -- prompts too long in characters ------------------------------------------------------
def byte_level_tokenizer(normalizer=None, pre_tokenizer=None, added=(), alphabet=None, unk=None):
    """A byte-level BPE whose longest token is 日本, 6 bytes spelt as 6 characters."""
    alphabet = alphabet or pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    merges = [("æ", "Ĺ"), ("æĹ", "¥"), ("æ", "ľ"), ("æľ", "¬"), ("æĹ¥", "æľ¬")]
    for token in [*(left + right for left, right in merges), *([unk] if unk else [])]:
        vocab[token] = len(vocab)
    core = Tokenizer(tokenizer_models.BPE(vocab, merges, unk_token=unk))
    core.normalizer = normalizer
    core.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core)
    tokenizer.add_tokens(list(added))
    return tokenizer


QWEN_PRE_TOKENIZER = pre_tokenizers.Sequence(
    [
        pre_tokenizers.Split(Regex(r"\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+"), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
)
"""Qwen2's shape: a regex split, then bytes spelt as characters."""


def test_a_byte_level_token_stands_for_at_most_its_bytes():
    tokenizer = byte_level_tokenizer()
    ids = tokenizer("日本日本a", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["æĹ¥æľ¬", "æĹ¥æľ¬", "a"]
    bound = char_bound(tokenizer)
    assert bound == CharBound(6)  # its 2 characters are 6 bytes
    assert bound.least_tokens("日本日本a") == 1 <= len(ids)  # 5 characters, 6 a token


def test_one_byte_characters_a_byte_level_vocabulary_lacks_are_dropped():
    without_4 = pre_tokenizers.ByteLevel.alphabet()
    without_4.remove("Ą")  # byte 4's spelling
    tokenizer = byte_level_tokenizer(alphabet=without_4)
    text = "\x04" * 100 + "日本"
    assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == 1
    bound = char_bound(tokenizer)
    assert bound == CharBound(6, "\x04")
    assert bound.least_tokens(text) == 1  # 2 characters kept of 102


@pytest.mark.parametrize(
    "tokenizer, bound",
    [
        (lambda: byte_level_tokenizer(added=["<|a-long-added-token|>"]), CharBound(22)),
        (lambda: byte_level_tokenizer(normalizers.NFC()), CharBound(24)),  # 4 compose to 1
        (lambda: byte_level_tokenizer(pre_tokenizer=QWEN_PRE_TOKENIZER), CharBound(6)),
        (lambda: byte_level_tokenizer(normalizers.Strip()), None),  # strips any number
        (lambda: byte_level_tokenizer(pre_tokenizer=pre_tokenizers.Whitespace()), None),
        (lambda: byte_level_tokenizer(pre_tokenizer=pre_tokenizers.Split(" ", "removed")), None),
        (lambda: byte_level_tokenizer(added=[AddedToken("<mask>", lstrip=True)]), None),
        # Without an unknown token, a character of several bytes could vanish whole...
        (lambda: byte_level_tokenizer(alphabet="æĹ¥ľ¬a"), None),
        # ...with one, each unknown byte is a token.
        (lambda: byte_level_tokenizer(alphabet="æĹ¥ľ¬a", unk="<unk>"), CharBound(6)),
    ],
)
def test_tokenizers_where_characters_can_vanish_have_no_bound(tokenizer, bound):
    assert char_bound(tokenizer()) == bound


def test_the_normal_forms_shrink_a_text_at_most_as_much_as_a_decomposition_grows():
    longest = max(len(unicodedata.normalize("NFD", chr(c))) for c in range(0x110000))
    assert NORMALIZER_SHRINK["NFC"] == NORMALIZER_SHRINK["NFKC"] == longest == 4


@pytest.mark.parametrize(
    "name, bound",
    [
        ("tiny", CharBound(len("</tool_response>"))),  # an added token, the longest string
        ("smollm2-135m", CharBound(81, "\x04\x06\x13\x14\x16\x1d")),  # "\n" + 80 spaces
    ],
)
def test_no_text_beats_a_real_tokenizers_bound(name, bound):
    tokenizer = AutoTokenizer.from_pretrained(models.resolve(name))
    assert char_bound(tokenizer) == bound
    rng = random.Random(0)
    alphabet = "ab \n\t\x04日本🙂é\u0301" + "".join(
        chr(rng.randrange(0, 0x3000)) for _ in range(99)
    )
    texts = ["".join(rng.choices(alphabet, k=rng.randint(1, 300))) for _ in range(200)]
    texts += ["\n" + " " * 3000, "</tool_response>" * 9, "<|im_start|>" * 9, "\x04" * 99 + "a"]
    for text in texts:
        tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert tokens >= bound.least_tokens(text)


def test_a_request_counts_its_strings_and_a_character_for_other_values():
    message = {"role": "user", "content": "abc"}
    call = {"function": {"name": "f", "arguments": {"x": 12345, "y": None}}}
    assert request_chars([message]) == 4 + 4 + 7 + 3
    assert request_chars({"tool_calls": [call]}) == 10 + 8 + 4 + 1 + 9 + (1 + 1) * 2
    assert request_chars(None) == 1


OVER = 200_000
"""Characters over what `tiny_engine`'s context holds: 8192 tokens of at most 16 characters."""


@pytest.mark.parametrize(
    "messages, tools",
    [
        ([{"role": "user", "content": "word " * 4_000_000}], None),  # 20 MB
        (MESSAGES, [{"type": "function", "function": {"name": "f", "description": "x" * OVER}}]),
        (
            [
                *MESSAGES,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"function": {"name": "f", "arguments": '{"a": "' + "y" * OVER + '"}'}}
                    ],
                },
                {"role": "user", "content": "and?"},
            ],
            None,
        ),
    ],
)
def test_a_prompt_too_long_in_characters_is_refused_before_tokenizing(tiny_engine, messages, tools):
    assert tiny_engine.context_length * 16 < OVER
    with pytest.raises(ValueError, match="characters, at least .* the model's context"):
        tiny_engine.generate(messages, tools)


def test_a_prompt_under_the_character_bound_is_counted_in_tokens(tiny_engine):
    under = [{"role": "user", "content": "word " * 20_000}]  # 100k characters, 20k tokens
    with pytest.raises(ValueError, match="tokens; the model's context"):
        tiny_engine.generate(under)


def test_a_request_over_the_bound_only_in_what_the_template_leaves_out_is_served(tiny_engine):
    # a part the template renders as nothing (the proxy refuses audio; the engine ignores it)
    audio = {"type": "input_audio", "input_audio": {"data": "A" * OVER, "format": "wav"}}
    parts = [{"type": "text", "text": MESSAGES[0]["content"]}, audio]
    completion = tiny_engine.generate(
        [{"role": "user", "content": parts}], sampling=SamplingParams(max_tokens=2)
    )
    assert list(completion.prompt_token_ids) == tiny_engine.encode(MESSAGES)
    assert len(completion.completion_token_ids) > 0


def test_top_logprobs_are_each_positions_likeliest_ids_as_the_model_scores_them(tiny_engine):
    sampling = SamplingParams(temperature=1.0, max_tokens=12, seed=5, top_logprobs=4)
    completion = tiny_engine.generate(MESSAGES, sampling=sampling)
    ids, prompt = completion.completion_token_ids, list(completion.prompt_token_ids)
    assert len(completion.top_ids) == len(completion.top_logprobs) == len(ids) > 0
    model = tiny_engine.model
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + list(ids)])).logits[0].float()
    full = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    for position, (top, values) in enumerate(
        zip(completion.top_ids, completion.top_logprobs, strict=True)
    ):
        expected = full[position].topk(4)
        assert list(top) == expected.indices.tolist()
        assert list(values) == pytest.approx(expected.values.tolist(), abs=1e-4)
        assert values[0] >= completion.completion_logprobs[position] - 1e-6
    # streamed: the chunks carry the same, and a request that asks for none gets none
    *chunks, final = tiny_engine.stream(MESSAGES, sampling=sampling)
    assert tuple(t for c in chunks for t in c.top_ids) == final.top_ids == completion.top_ids
    plain = tiny_engine.generate(MESSAGES, sampling=dataclasses.replace(sampling, top_logprobs=0))
    assert plain.top_ids == plain.top_logprobs == ()
    assert plain.completion_token_ids == ids
    with pytest.raises(ValueError, match="top_logprobs must be in"):
        SamplingParams(top_logprobs=21)
