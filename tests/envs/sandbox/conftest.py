"""Sandbox fixtures: a real Docker daemon (started here as root when none answers, and
stopped again at the end of the session) with the locally built base image, and a fresh
sandbox of each backend."""

from __future__ import annotations

import os
import shutil

import pytest

from envs.sandbox import SandboxConfig, SandboxError, make_sandbox

BACKENDS = ["bwrap", pytest.param("docker", marks=pytest.mark.docker)]


@pytest.fixture(scope="session")
def docker_daemon():
    """A Docker daemon that answers and the sandbox base image; skips where neither can be
    had (not root, no docker.io)."""
    from envs.sandbox.dockerd import DockerDaemon, ensure_base_image

    if os.geteuid() != 0 and shutil.which("docker") is None:
        pytest.skip("Docker is not installed and cannot be installed without root")
    try:
        daemon = DockerDaemon.ensure()
    except SandboxError as error:
        pytest.skip(str(error))
    try:
        ensure_base_image()
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """Each sandbox backend in turn ("docker" only with the `docker` marker)."""
    if request.param == "docker":
        request.getfixturevalue("docker_daemon")
    return request.param


@pytest.fixture
def sandbox(backend):
    """A fresh sandbox with tight limits, closed after the test."""
    config = SandboxConfig(
        memory_mb=256, max_procs=128, timeout=10.0, max_output=8192, max_file_mb=64
    )
    box = make_sandbox(backend, config)
    box.start()
    yield box
    box.close()
