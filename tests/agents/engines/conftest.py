"""Fixtures for the engine tests: one real vLLM server on the `tiny` model for the session
(its start takes 30-70 s on 2 cores), shared by the vLLM and remote engine tests. Tests that
start vLLM themselves (`vllm_alone`) run after it is closed: never two servers at once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from agents import models

CLOSE_TEST = "test_vllm.py::test_close_leaves_no_process_behind"


@pytest.hookimpl(tryfirst=True)  # before xdist adds "@<group>" to each node id
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The close test closes the session's vLLM server: it runs right after the last other
    test that uses the server, so that they all share one; the tests that start their own
    server (`vllm_alone`) run right after it."""
    close = [item for item in items if item.nodeid.endswith(CLOSE_TEST)]
    alone = [item for item in items if "vllm_alone" in getattr(item, "fixturenames", ())]
    rest = [item for item in items if item not in close and item not in alone]
    users = [i for i, item in enumerate(rest) if "vllm_engine" in getattr(item, "fixturenames", ())]
    at = users[-1] + 1 if users else len(rest)
    items[:] = rest[:at] + close + alone + rest[at:]


@pytest.fixture(scope="session")
def _vllm_engines() -> Iterator[list]:
    engines: list = []
    yield engines
    for engine in engines:
        engine.close()


@pytest.fixture
def vllm_engine(_vllm_engines: list):
    """`VLLMEngine("tiny")` from `.venv-vllm` (built by scripts/setup_vllm.sh), shared by the
    session; started again only if a test closed it (the close test runs last)."""
    from agents.engines.vllm import VLLMEngine

    if not _vllm_engines or _vllm_engines[-1].closed:
        _vllm_engines.append(VLLMEngine("tiny"))
    return _vllm_engines[-1]


@pytest.fixture
def vllm_alone(_vllm_engines: list) -> None:
    """For a test that starts vLLM itself: closes the session's server first (2 cores and
    one server's memory are all this machine has), which the next user starts again."""
    for engine in _vllm_engines:
        engine.close()


@pytest.fixture(scope="session")
def tiny_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Two random LoRA adapters on `tiny` (non-zero B, so each changes the outputs)."""
    root = tmp_path_factory.mktemp("adapters")
    return {version: save_random_adapter(root / f"v{version}", seed=version) for version in (1, 2)}


def save_random_adapter(path: Path, seed: int) -> Path:
    model, _ = models.load("tiny")
    torch.manual_seed(seed)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(path)
    return path
