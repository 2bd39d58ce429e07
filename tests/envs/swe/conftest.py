"""SWE env fixtures: the sandbox fixtures (a real Docker daemon among them), and a skip
where the projects' sources were not fetched (`python -m envs.swe.sources`)."""

import pytest

from envs.swe.sources import PROJECTS, tree
from tests.envs.sandbox.conftest import backend, docker_daemon  # noqa: F401


@pytest.fixture(scope="session", autouse=True)
def sources():
    """Every project's source tree; skips the module's tests when set-up did not fetch them."""
    try:
        return [tree(project) for project in PROJECTS]
    except FileNotFoundError as error:
        pytest.skip(str(error))
