"""Shared fixtures: the tiny model and an embedded engine on it, built once per session."""

from __future__ import annotations

import pytest

from agents.engines.embedded import EmbeddedEngine


@pytest.fixture(scope="session")
def tiny_engine() -> EmbeddedEngine:
    """The embedded engine on the `tiny` model (random weights: output is noise, but
    token ids and log-probs are real)."""
    return EmbeddedEngine("tiny", threads=2)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests need a CUDA device: skipped, saying so, where torch sees none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch sees none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
