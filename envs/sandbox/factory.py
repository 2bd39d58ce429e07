"""Picks a sandbox backend by name: "bwrap", "docker", or "auto" (docker when a daemon
answers, else bwrap); and keeps started sandboxes ready in a pool."""

from __future__ import annotations

import logging
import threading
from typing import Literal

from envs.sandbox.base import Sandbox, closed_on_failure
from envs.sandbox.records import SandboxConfig

logger = logging.getLogger(__name__)

Backend = Literal["auto", "bwrap", "docker"]
BACKENDS = ("auto", "bwrap", "docker")


def resolve_backend(name: str) -> str:
    """The concrete backend `name` stands for on this machine, now."""
    if name not in BACKENDS:
        raise ValueError(f"unknown sandbox {name!r}; choose one of {', '.join(BACKENDS)}")
    if name != "auto":
        return name
    from envs.sandbox.docker import docker_answers

    return "docker" if docker_answers() else "bwrap"


def make_sandbox(name: str = "auto", config: SandboxConfig | None = None) -> Sandbox:
    """A new sandbox of backend `name` (see `resolve_backend`)."""
    backend = resolve_backend(name)
    if backend == "docker":
        from envs.sandbox.docker import DockerSandbox

        return DockerSandbox(config)
    from envs.sandbox.bwrap import BwrapSandbox

    return BwrapSandbox(config)


class SandboxPool:
    """Started sandboxes of one backend and config kept ready, so that an env's reset takes
    one at once instead of waiting for a container or namespace to start; spares are made
    by a background thread after each `take`. `close` closes the spares.

    Args:
        name: the backend ("auto", "bwrap" or "docker").
        config: the sandboxes' config.
        size: how many started spares to keep.
    """

    def __init__(self, name: str, config: SandboxConfig, size: int = 2):
        if size < 1:
            raise ValueError(f"a sandbox pool needs at least one spare, got size={size}")
        self.backend = resolve_backend(name)
        self.config = config
        self.size = size
        self._spares: list[Sandbox] = []
        self._lock = threading.Lock()
        self._filling = False
        self._closed = False
        self._refill()

    def take(self) -> Sandbox:
        """A started sandbox: a spare when one is ready, else a new one."""
        with self._lock:
            if self._closed:
                raise ValueError("the sandbox pool is closed")
            spare = self._spares.pop(0) if self._spares else None
        if spare is None:
            spare = self._make()
        self._refill()
        return spare

    def ready(self) -> int:
        """Spares ready now."""
        with self._lock:
            return len(self._spares)

    def close(self) -> None:
        """Closes every spare; sandboxes already taken belong to their takers."""
        with self._lock:
            self._closed = True
            spares, self._spares = self._spares, []
        for sandbox in spares:
            sandbox.close()

    def _make(self) -> Sandbox:
        with closed_on_failure(make_sandbox(self.backend, self.config)) as sandbox:
            sandbox.start()
        return sandbox

    def _refill(self) -> None:
        with self._lock:
            if self._filling or self._closed:
                return
            self._filling = True
        threading.Thread(target=self._fill, name="sandbox-pool", daemon=True).start()

    def _fill(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed or len(self._spares) >= self.size:
                        return
                sandbox = self._make()
                with self._lock:
                    if self._closed:
                        break
                    self._spares.append(sandbox)
                    continue
            sandbox.close()
        except Exception as error:  # a failed spare is made again at the next take
            logger.warning("sandbox pool: cannot make a spare: %s", error)
        finally:
            with self._lock:
                self._filling = False
