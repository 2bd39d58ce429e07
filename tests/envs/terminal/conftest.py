"""The terminal env's tests use the sandbox fixtures (a real Docker daemon among them)."""

from tests.envs.sandbox.conftest import backend, docker_daemon  # noqa: F401
