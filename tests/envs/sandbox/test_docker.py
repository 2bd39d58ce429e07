"""Docker-specific duties: the base image is built locally under the tag the backend
expects, containers are labelled, and the reaper removes those whose parent died."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from envs.sandbox import SandboxError
from envs.sandbox import docker as docker_module
from envs.sandbox.cleanup import LABEL, reap_docker_orphans
from envs.sandbox.docker import BASE_PACKAGES, DockerSandbox, base_image_tag

ROOT = Path(__file__).resolve().parents[3]


def test_the_build_script_and_the_backend_agree_on_the_image():
    script = (ROOT / "scripts" / "docker_base_image.sh").read_text()
    assert re.search(r'^packages="([^"]+)"', script, re.MULTILINE).group(1) == BASE_PACKAGES
    assert "docker import" in script and "docker pull" not in script


@pytest.mark.docker
def test_base_image_is_local_and_containers_have_no_network(docker_daemon):
    import docker

    client = docker.from_env()
    image = client.images.get(base_image_tag())
    assert image.attrs["RepoDigests"] == []  # imported here, never pulled from a registry
    from envs.sandbox.docker import DockerSandbox

    with DockerSandbox() as sandbox:
        attrs = client.containers.get(sandbox.container.id).attrs
        assert attrs["HostConfig"]["NetworkMode"] == "none"
        assert attrs["Config"]["Labels"][LABEL] == "1"
        assert sandbox.exec("ls /sys/class/net").stdout.split() == ["lo"]


@pytest.mark.docker
def test_the_reaper_removes_containers_whose_parent_died(docker_daemon):
    import docker

    crash = (
        "import os\n"
        "from envs.sandbox.docker import DockerSandbox\n"
        "sandbox = DockerSandbox()\n"
        "print(sandbox.container.id, flush=True)\n"
        "os._exit(1)  # a crash: close() never runs\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", crash], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    orphan = result.stdout.strip()
    client = docker.from_env()
    container = client.containers.get(orphan)
    assert container.status == "running"
    assert container.name in reap_docker_orphans(client)
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(orphan)


class SlowInitContainer:
    """Stands in for a container whose init forks its keep-alive late (a race a real daemon
    cannot be made to lose on demand): the first looks find no child."""

    def __init__(self, empty_looks: int):
        self.empty_looks, self.removed = empty_looks, False

    def exec_run(self, command):
        if self.empty_looks:
            self.empty_looks -= 1
            return 0, b"\n"
        return 0, b"7\n"

    def remove(self, force=False):
        self.removed = True


def test_the_keep_alive_is_looked_for_again_until_the_init_has_forked_it(monkeypatch):
    sandbox = object.__new__(DockerSandbox)
    sandbox.container = SlowInitContainer(empty_looks=3)
    assert sandbox._keepalive_pid() == "7" and not sandbox.container.removed
    monkeypatch.setattr(docker_module, "_KEEPALIVE_WAIT_S", 0.2)
    sandbox.container = SlowInitContainer(empty_looks=1_000)
    with pytest.raises(SandboxError, match="keep-alive was not found"):
        sandbox._keepalive_pid()
    assert sandbox.container.removed
