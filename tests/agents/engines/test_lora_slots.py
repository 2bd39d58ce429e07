"""Adapter slots in the embedded engine: publishing copies weights into a preallocated slot
(no new peft modules), a swap in the middle of generation fails no request, and what a
slot serves equals what a freshly loaded adapter serves."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from peft import LoraConfig, get_peft_model

from agents import models
from agents.engines.base import POLICY, Completion, SamplingParams
from agents.engines.embedded import EmbeddedEngine
from agents.engines.lora_slots import lora_shape, read_adapter
from tests.agents.engines.conftest import save_random_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
PROMPTS = [[{"role": "user", "content": "word " * n}] for n in range(1, 7)]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("slot-adapters")
    return [str(save_random_adapter(root / f"v{v}", seed=v)) for v in range(1, 6)]


def served(engine, prompts=PROMPTS):
    return [engine.generate(p, sampling=GREEDY) for p in prompts]


def wait_for_spares(engine):
    """One scheduler round after the first load: the spare slots are added by then."""
    engine.score([1, 2], [3], adapter=POLICY)


def test_later_versions_are_copied_into_slots_not_loaded_by_peft(adapters, monkeypatch):
    engine = EmbeddedEngine("tiny", threads=1)
    engine.load_adapter(adapters[0], 1)
    wait_for_spares(engine)
    peft = engine._peft
    slots = list(peft.peft_config)
    monkeypatch.setattr(peft, "load_adapter", lambda *a, **k: pytest.fail("peft loaded it"))
    monkeypatch.setattr(peft, "add_adapter", lambda *a, **k: pytest.fail("peft added one"))
    for version, path in enumerate(adapters[1:], start=2):
        engine.load_adapter(path, version)
        assert engine.generate(PROMPTS[0], sampling=GREEDY).policy_version == version
    assert list(peft.peft_config) == slots
    engine.close()


def test_prepared_slots_serve_the_base_until_the_first_version_which_is_a_copy(
    adapters, monkeypatch
):
    engine = EmbeddedEngine("tiny", threads=1)
    plain = EmbeddedEngine("tiny", threads=1)
    engine.prepare_adapter(adapters[0])
    assert engine.policy_version == 0
    peft = engine._peft
    with monkeypatch.context() as patch:  # base rows skip peft's forward altogether
        patch.setattr(peft, "forward", lambda *a, **k: pytest.fail("base rows went through peft"))
        for ours, theirs in zip(served(engine), served(plain), strict=True):
            assert ours.completion_token_ids == theirs.completion_token_ids
    monkeypatch.setattr(peft, "load_adapter", lambda *a, **k: pytest.fail("peft loaded it"))
    monkeypatch.setattr(peft, "add_adapter", lambda *a, **k: pytest.fail("peft added one"))
    engine.load_adapter(adapters[1], 1)
    plain.load_adapter(adapters[1], 1)
    for ours, theirs in zip(served(engine), served(plain), strict=True):
        assert ours.policy_version == 1
        assert ours.completion_token_ids == theirs.completion_token_ids
        assert ours.completion_logprobs == pytest.approx(theirs.completion_logprobs, abs=1e-5)
    ids = (ours.prompt_token_ids, ours.completion_token_ids)
    for adapter in (None, POLICY, None, POLICY):  # LoRA layers switched off, on, off, on
        assert engine.score(*ids, adapter=adapter) == pytest.approx(
            plain.score(*ids, adapter=adapter), abs=1e-5
        )
    assert engine.score(*ids, adapter=None) != pytest.approx(
        engine.score(*ids, adapter=POLICY), abs=1e-3
    )
    engine.close()
    plain.close()


def test_a_slot_serves_exactly_what_a_freshly_loaded_adapter_serves(adapters):
    recycled = EmbeddedEngine("tiny", threads=1)
    for version, path in enumerate(adapters[:4], start=1):  # slot of version 1 is reused
        recycled.load_adapter(path, version)
        wait_for_spares(recycled)
    fresh = EmbeddedEngine("tiny", threads=1)
    fresh.load_adapter(adapters[3], 1)
    for ours, theirs in zip(served(recycled), served(fresh), strict=True):
        assert ours.completion_token_ids == theirs.completion_token_ids
        assert ours.completion_logprobs == pytest.approx(theirs.completion_logprobs, abs=1e-5)
    one = served(fresh)[0]
    ids = (one.prompt_token_ids, one.completion_token_ids)
    assert recycled.score(*ids, adapter=POLICY) == pytest.approx(
        fresh.score(*ids, adapter=POLICY), abs=1e-5
    )
    recycled.close()
    fresh.close()


def test_swaps_mid_generation_fail_no_request_and_keep_versions(adapters):
    engine = EmbeddedEngine("tiny", threads=1)
    engine.load_adapter(adapters[0], 1)
    wait_for_spares(engine)
    long = SamplingParams(temperature=1.0, max_tokens=30)
    stop = threading.Event()
    results: list[Completion] = []
    failures: list[str] = []

    def load(prompt):
        while not stop.is_set():
            try:
                results.append(engine.generate(prompt, sampling=long))
            except Exception as error:  # any failure is what this test counts
                failures.append(repr(error))

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        for prompt in PROMPTS:
            pool.submit(load, prompt)
        for version, path in enumerate(adapters[1:], start=2):
            before = len(results)
            while len(results) < before + 3:
                stop.wait(0.02)
            engine.load_adapter(path, version)
        stop.set()
    assert failures == []
    assert {r.policy_version for r in results} >= {1, 2, 3, 4}
    # Each request ran start to finish on the version it began with: its log-probs are
    # those its version's adapter gives (rescored on a fresh engine per version).
    for version, path in enumerate(adapters[:4], start=1):
        mine = [r for r in results if r.policy_version == version][:2]
        check = EmbeddedEngine("tiny", threads=1)
        check.load_adapter(path, 1)
        for result in mine:
            rescored = check.score(
                result.prompt_token_ids, result.completion_token_ids, adapter=POLICY
            )
            assert rescored == pytest.approx(list(result.completion_logprobs), abs=1e-4)
        check.close()
    assert not any(engine._scheduler.adapters.users.values())
    engine.close()


def test_an_adapter_of_another_rank_gets_its_own_slots(adapters, tmp_path):
    engine = EmbeddedEngine("tiny", threads=1)
    engine.load_adapter(adapters[0], 1)
    wait_for_spares(engine)
    model, _ = models.load("tiny")
    torch.manual_seed(9)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"], init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(tmp_path / "r8")
    engine.load_adapter(str(tmp_path / "r8"), 2)
    wait_for_spares(engine)
    fresh = EmbeddedEngine("tiny", threads=1)
    fresh.load_adapter(str(tmp_path / "r8"), 1)
    ours, theirs = served(engine, PROMPTS[:2]), served(fresh, PROMPTS[:2])
    assert [c.completion_token_ids for c in ours] == [c.completion_token_ids for c in theirs]
    shapes = {s.shape for s in engine._scheduler.adapters.slots.values()}
    assert shapes == {read_adapter(str(tmp_path / "r8")).shape}  # rank-4 slots are gone
    engine.close()
    fresh.close()


def test_unsupported_adapters_have_no_slot_shape():
    assert lora_shape({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}) is not None
    assert lora_shape({"peft_type": "LORA", "r": 4, "use_dora": True}) is None
    assert lora_shape({"peft_type": "LORA", "r": 4, "rank_pattern": {"q": 2}}) is None
    assert lora_shape({"peft_type": "IA3"}) is None
