"""Shared fixtures: the tiny model and an embedded engine on it, built once per session;
each xdist worker's share of the cores."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from agents.engines.embedded import EmbeddedEngine


def worker_threads() -> int:
    """The torch threads each test process may use: all the cores in one process, an equal
    share of them under xdist. Two workers on two cores whose processes each start an
    OpenMP team of two slow each other down severalfold (the teams wait for workers the
    other process keeps off a core): nine training tests took 351 s at -n 2 with a team
    of two a process, 184 s with one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    return max(1, cores // workers)


# Before torch is imported, here and in every process a test starts (runs, servers): the
# team size is read once, as OpenMP starts. A value the developer set is kept.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", str(worker_threads()))


@pytest.fixture(scope="session")
def tiny_engine() -> EmbeddedEngine:
    """The embedded engine on the `tiny` model (random weights: output is noise, but
    token ids and log-probs are real)."""
    from agents.engines.embedded import EmbeddedEngine

    return EmbeddedEngine("tiny", threads=min(2, worker_threads()))


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
