"""Shared fixtures: the tiny model and an embedded engine on it, built once per session."""

from __future__ import annotations

import pytest

from agents.engines.embedded import EmbeddedEngine


@pytest.fixture(scope="session")
def tiny_engine() -> EmbeddedEngine:
    """The embedded engine on the `tiny` model (random weights: output is noise, but
    token ids and log-probs are real)."""
    return EmbeddedEngine("tiny", threads=2)


SHARED_DAEMONS = ("docker", "vllm")
"""Markers of tests that share one daemon per machine (a Docker daemon a session starts and
stops, vLLM servers that take gigabytes each): under xdist each marker's tests run on one
worker. Ray's tests (one Ray head on its fixed ports) share a file, hence a worker."""


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests need a CUDA device: skipped, saying so, where torch sees none. Each test
    gets its xdist group: its daemon's, or else its file's, so that a module's fixtures are
    built once (`--dist loadgroup`; without xdist the group does nothing)."""
    import torch

    skip = pytest.mark.skip(reason="needs a CUDA device (torch sees none)")
    grouped = config.pluginmanager.hasplugin("xdist")  # not under `-p no:xdist`
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
        if not grouped:
            continue
        daemon = next((name for name in SHARED_DAEMONS if name in item.keywords), None)
        item.add_marker(pytest.mark.xdist_group(daemon or item.nodeid.partition("::")[0]))


@pytest.hookimpl(trylast=True)  # after xdist's hook, which adds "@<group>" to each node id
def pytest_collection_finish(session: pytest.Session) -> None:
    """Under `--dist loadgroup` the groups must have reached the node ids; a pytest that
    keeps ids where xdist cannot rename them would schedule every test alone, silently."""
    if getattr(session.config.option, "loadgroup", False) and session.items:
        if "@" not in session.items[0].nodeid:
            raise pytest.UsageError(
                "xdist's groups did not reach the node ids (pytest-xdist and this pytest "
                "disagree; see pyproject.toml's dev pins): the tests would share daemons "
                "across workers"
            )
