import hashlib

import pytest
import torch

from agents import models

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


@pytest.mark.parametrize("name", ["tiny", "smollm2-135m"])
def test_model_resolves_loads_and_replies_with_a_tool_in_the_prompt(name):
    path = models.resolve(name)
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    model, tokenizer = models.load(name)
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
