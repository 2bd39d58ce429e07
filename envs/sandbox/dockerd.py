"""Starting a Docker daemon where none answers (as root, with no systemd), and building the
sandbox base image once. Used by the tests and the benchmark; nothing runs at import.

    python -m envs.sandbox.dockerd     # start dockerd if needed, build the image, stop
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

from envs.sandbox.docker import base_image_tag, docker_answers
from envs.sandbox.records import SandboxError

logger = logging.getLogger(__name__)

BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "docker_base_image.sh"


class DockerDaemon:
    """A daemon that answers: either one already running, or one this object started (and
    stops again with `stop`).

    Args:
        process: the dockerd this object started, if it started one.
    """

    def __init__(self, process: subprocess.Popen[bytes] | None = None):
        self.process = process

    @classmethod
    def ensure(
        cls, timeout: float = 60.0, log_path: str = "/tmp/clawgym-dockerd.log"
    ) -> DockerDaemon:
        """A daemon that answers, starting `dockerd` when none does (needs root)."""
        if docker_answers():
            return cls(None)
        if os.geteuid() != 0 or shutil.which("dockerd") is None:
            raise SandboxError("no Docker daemon answers, and dockerd cannot be started here")
        logger.info("starting dockerd (log: %s)", log_path)
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                ["dockerd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        daemon = cls(process)
        deadline = time.monotonic() + timeout
        while not docker_answers():
            if process.poll() is not None or time.monotonic() > deadline:
                daemon.stop()
                raise SandboxError(f"dockerd did not start; see {log_path}")
            time.sleep(0.2)
        return daemon

    @property
    def started(self) -> bool:
        return self.process is not None

    def stop(self) -> None:
        """Stops the daemon if this object started it; idempotent."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def image_exists(tag: str) -> bool:
    import docker

    client = docker.from_env(timeout=30)
    try:
        client.images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False
    finally:
        client.close()


def ensure_base_image(timeout: float = 900.0) -> str:
    """The base image's tag, building it with scripts/docker_base_image.sh if missing."""
    tag = base_image_tag()
    if image_exists(tag):
        return tag
    if not BUILD_SCRIPT.exists():
        raise SandboxError(f"image {tag} is missing and {BUILD_SCRIPT} is not here to build it")
    logger.info("building %s (about a minute)", tag)
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0 or result.stdout.strip() != tag:
        raise SandboxError(f"building {tag} failed: {result.stderr[-2000:]}")
    return tag


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    daemon = DockerDaemon.ensure()
    try:
        logger.info("base image: %s", ensure_base_image())
    finally:
        daemon.stop()


if __name__ == "__main__":
    main()
