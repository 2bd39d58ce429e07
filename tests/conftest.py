"""Shared fixtures: the tiny model and an embedded engine on it, built once per session."""

from __future__ import annotations

import pytest

from agents.engines.embedded import EmbeddedEngine


@pytest.fixture(scope="session")
def tiny_engine() -> EmbeddedEngine:
    """The embedded engine on the `tiny` model (random weights: output is noise, but
    token ids and log-probs are real)."""
    return EmbeddedEngine("tiny", threads=2)
