"""Merged LoRA weights in the embedded engine: a batch whose rows all run on one adapter
skips peft's LoRA layers once that adapter is merged, serves what peft's path serves, and
leaves the base weights exactly as they were for every other pass."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from agents import models
from agents.engines.base import SamplingParams
from agents.engines.embedded import EmbeddedEngine
from agents.engines.merged_lora import MERGE_AFTER, MergedLora
from tests.agents.engines.conftest import save_random_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = [[{"role": "user", "content": f"count the words: {'word ' * n}"}] for n in (1, 4, 9)]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge-adapters")
    return [str(save_random_adapter(root / f"v{v}", seed=40 + v)) for v in range(1, 5)]


@pytest.fixture
def engines():
    """An engine that merges and one that never does (peft's LoRA path), both on `tiny`."""
    merging = EmbeddedEngine("tiny", threads=1)
    plain = EmbeddedEngine("tiny", threads=1, merge_lora=False)
    yield merging, plain
    merging.close()
    plain.close()


def merged(engine: EmbeddedEngine) -> MergedLora:
    return engine._scheduler.adapters.merged


def base_weights(engine: EmbeddedEngine) -> dict[str, torch.Tensor]:
    return {
        name: param
        for name, param in engine.model.named_parameters()
        if ".base_layer." in name or "lora_" not in name
    }


def assert_same_replies(ours, theirs, tolerance):
    for one, other in zip(ours, theirs, strict=True):
        assert one.completion_token_ids == other.completion_token_ids
        assert one.completion_logprobs == pytest.approx(other.completion_logprobs, abs=tolerance)


def test_a_uniform_batch_runs_merged_and_serves_what_peft_serves(engines, adapters, monkeypatch):
    merging, plain = engines
    for engine in engines:
        engine.load_adapter(adapters[0], 1)
    peft_passes = []
    forward = merging._peft.forward
    monkeypatch.setattr(
        merging._peft, "forward", lambda *a, **k: peft_passes.append(1) or forward(*a, **k)
    )
    ours = [merging.generate(p, sampling=GREEDY) for p in PROMPTS]
    theirs = [plain.generate(p, sampling=GREEDY) for p in PROMPTS]
    assert_same_replies(ours, theirs, 1e-4)
    assert merged(merging).merges == 1
    assert merged(plain).merges == 0
    # each reply is 12 passes; only the passes before the merge went through peft
    assert len(peft_passes) == MERGE_AFTER - 1


def test_base_passes_after_a_merge_get_the_base_weights_back_exactly(engines, adapters):
    merging, plain = engines
    merging.load_adapter(adapters[0], 1)
    before = {
        name: (param, param.detach().clone()) for name, param in base_weights(merging).items()
    }
    merging.generate(PROMPTS[1], sampling=GREEDY)
    assert merged(merging).merges == 1
    ours = [merging.generate(p, sampling=GREEDY, adapter=None) for p in PROMPTS]
    theirs = [plain.generate(p, sampling=GREEDY, adapter=None) for p in PROMPTS]
    assert_same_replies(ours, theirs, 0.0)
    after = base_weights(merging)
    assert after.keys() == before.keys()
    for name, (param, values) in before.items():
        assert after[name] is param, name  # the same tensors, back in place
        assert torch.equal(param, values), name  # never written


def test_every_new_version_in_a_reused_slot_is_merged_again(engines, adapters):
    merging, plain = engines
    for version, path in enumerate(adapters, start=1):  # the first version's slot comes back
        for engine in engines:
            engine.load_adapter(path, version)
        ours = [merging.generate(p, sampling=GREEDY) for p in PROMPTS]
        theirs = [plain.generate(p, sampling=GREEDY) for p in PROMPTS]
        assert {one.policy_version for one in ours} == {version}
        assert_same_replies(ours, theirs, 1e-4)
        assert merged(merging).merges == version


def test_a_merge_waits_for_a_streak_and_survives_a_miss():
    model, _ = models.load("tiny")
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft = get_peft_model(model, config)
    layers = tuple(m for m in peft.modules() if isinstance(getattr(m, "scaling", None), dict))
    own = [layer.base_layer.weight for layer in layers]
    merging = MergedLora()
    key = ("default", 0)
    with torch.inference_mode():
        assert [merging.use(key, layers) for _ in range(MERGE_AFTER)] == [False] * (
            MERGE_AFTER - 1
        ) + [True]
        expected = own[0] + layers[0].get_delta_weight("default")
        assert torch.equal(layers[0].base_layer.weight, expected)
        merging.miss()  # a mixed pass: the base weights are back, the merged set is kept
        assert all(layer.base_layer.weight is w for layer, w in zip(layers, own, strict=True))
        assert merging.use(key, layers)  # no new streak for the set it holds
        assert merging.merges == 1
        assert not merging.use(("default", 1), layers)  # a refilled slot starts a streak
        assert all(layer.base_layer.weight is w for layer, w in zip(layers, own, strict=True))
    assert not MergedLora(enabled=False).use(key, layers)
