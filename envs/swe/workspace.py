"""Workspaces of the SWE env: a sandbox holding one project's source tree at /testbed, in
the state of one task instance (the bug in place), with a fresh git repository whose only
commit is that state, so that `git diff` is exactly the agent's change.

- docker: one image per project version, built locally from the sandbox base image with
  the project's tree baked in at /testbed (nothing is pulled or pip-installed: the project
  runs from its tree on PYTHONPATH with the image's python3 and pytest). A reset starts a
  container from that image: its file system is an overlay over the image's layers, so
  the reset copies nothing (copy-on-write), then reverses the instance's fix and makes
  the git repository. `pool` keeps started containers ready per project.
- bwrap: the same tree copied from the source cache into the sandbox's private /testbed
  (a few hundred kilobytes), then the same steps.
The history never holds the fixed code: the repository is created after the bug is put
in place, and the image's lower layer is not reachable from inside the container.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import tarfile
import threading
from dataclasses import replace
from pathlib import Path

from envs.sandbox import (
    Sandbox,
    SandboxConfig,
    SandboxError,
    closed_on_failure,
    make_sandbox,
    resolve_backend,
)
from envs.swe.sources import TESTBED, Project, tree

logger = logging.getLogger(__name__)

_MARKER = ".clawgym-complete"
_DELIMITER = "__CLAWGYM_PATCH_7f3a__"
# Reverses the fix (puts the bug in place) and starts the history at that state. The patch
# travels in the command itself: a file written through docker's API costs 0.2 s.
_SETUP = (
    f"cd {TESTBED} && {{patch}}git init -q && git add -A && "
    "git -c user.name=clawgym -c user.email=clawgym@localhost commit -q --no-verify "
    "-m 'initial commit'"
)


def heredoc(command: str, text: str) -> str:
    """`command` reading `text` on stdin, as one bash command."""
    body = text if text.endswith("\n") else text + "\n"
    return f"{command} <<'{_DELIMITER}'\n{body}{_DELIMITER}\n"


def setup_command(fix_patch: str) -> str:
    """The set-up of an instance's workspace in a fresh tree."""
    if not fix_patch.strip():
        return _SETUP.format(patch="")
    apply = heredoc("git apply -R --whitespace=nowarn", fix_patch)
    return _SETUP.format(patch=f"{{ {apply}}} && ")


_DOCKERFILE = """\
FROM {base}
COPY testbed {testbed}
ENV PYTHONPATH={pythonpath} PYTHONDONTWRITEBYTECODE=1
WORKDIR {testbed}
"""


def project_config(project: Project, base: SandboxConfig) -> SandboxConfig:
    """The sandbox config of a project's workspaces: /testbed writable, its PYTHONPATH."""
    env = (
        ("PYTHONPATH", project.pythonpath),
        ("PYTHONDONTWRITEBYTECODE", "1"),
        ("PYTHONHASHSEED", "0"),  # the grader's test ids, whatever the agent runs
    )
    return replace(base, workdir=TESTBED, writable=(TESTBED,), env=base.env + env)


def project_image(project: Project) -> str:
    """The tag of the project's docker image; it changes with the base image and the tree."""
    from envs.sandbox.docker import base_image_tag

    base = base_image_tag()
    digest = hashlib.sha256(f"{base} {project.key} {project.sha256} {_DOCKERFILE}".encode())
    return f"clawgym/swe-{project.name}:{project.version}-{digest.hexdigest()[:10]}"


def ensure_image(project: Project) -> str:
    """Builds the project's image from the local base image unless it exists; its tag."""
    import docker

    from envs.sandbox.docker import base_image_tag

    tag = project_image(project)
    client = docker.from_env(timeout=300)
    try:
        try:
            client.images.get(tag)
            return tag
        except docker.errors.ImageNotFound:
            pass
        dockerfile = _DOCKERFILE.format(
            base=base_image_tag(), testbed=TESTBED, pythonpath=project.pythonpath
        )
        context = _build_context(tree(project), dockerfile)
        logger.info("building %s", tag)
        # pull=False: the base image is local, built by scripts/docker_base_image.sh
        client.images.build(
            fileobj=context, custom_context=True, tag=tag, pull=False, rm=True, network_mode="none"
        )
        return tag
    finally:
        client.close()


def _build_context(source: Path, dockerfile: str) -> io.BytesIO:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        data = dockerfile.encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        tar.add(source, arcname="testbed", filter=_without_marker)
    buffer.seek(0)
    return buffer


def _without_marker(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    return None if info.name.endswith(_MARKER) else info


class Workspaces:
    """Opens workspaces for instances on one backend.

    Args:
        backend: "auto", "bwrap" or "docker".
        base: sandbox limits; paths and environment are set per project.
        pool: docker only: started containers kept ready per project (0: none).
    """

    def __init__(self, backend: str = "auto", base: SandboxConfig | None = None, pool: int = 0):
        self.backend = resolve_backend(backend)
        self.base = base or SandboxConfig(timeout=60.0)
        self.pool_size = pool
        self._spares: dict[str, list[Sandbox]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def open(self, project: Project, fix_patch: str = "") -> Sandbox:
        """A started sandbox with `project`'s tree at /testbed, `fix_patch` reversed (the
        instance's bug in place) and committed as the repository's first commit."""
        sandbox = self._fresh(project)
        try:
            result = sandbox.exec(setup_command(fix_patch), timeout=120)
            if result.exit_code != 0:
                raise SandboxError(f"workspace set-up failed: {(result.stdout + result.stderr)}")
        except BaseException:
            sandbox.close()
            raise
        self._refill(project)
        return sandbox

    def _fresh(self, project: Project) -> Sandbox:
        """A started sandbox holding the project's pristine tree."""
        with self._lock:
            spares = self._spares.get(project.key)
            if spares:
                return spares.pop()
        return self._make(project)

    def _make(self, project: Project) -> Sandbox:
        config = project_config(project, self.base)
        if self.backend == "docker":
            from envs.sandbox.docker import DockerSandbox

            # The project's image holds its tree already.
            with closed_on_failure(DockerSandbox(config, image=ensure_image(project))) as docker:
                docker.start()
            return docker
        with closed_on_failure(make_sandbox("bwrap", config)) as sandbox:
            _copy_tree(tree(project), sandbox)
            sandbox.start()
        return sandbox

    def _refill(self, project: Project) -> None:
        if self.backend != "docker" or not self.pool_size:
            return
        threading.Thread(target=self._fill, args=(project,), daemon=True).start()

    def _fill(self, project: Project) -> None:
        try:
            with self._lock:
                if self._closed or len(self._spares.get(project.key, ())) >= self.pool_size:
                    return
            sandbox = self._make(project)
            with self._lock:
                if not self._closed:
                    self._spares.setdefault(project.key, []).append(sandbox)
                    return
            sandbox.close()
        except Exception as error:  # the next open makes one itself
            logger.warning("swe workspace pool: %s", error)

    def close(self) -> None:
        """Closes the spare sandboxes; opened ones belong to their users. Idempotent."""
        with self._lock:
            self._closed = True
            spares, self._spares = self._spares, {}
        for sandboxes in spares.values():
            for sandbox in sandboxes:
                sandbox.close()


def _copy_tree(source: Path, sandbox: Sandbox) -> None:
    """Copies the pristine tree into a bwrap sandbox's /testbed, owned by its uid."""
    from envs.sandbox.bwrap import BwrapSandbox

    assert isinstance(sandbox, BwrapSandbox)
    target = sandbox.mounts[TESTBED]
    ignore = shutil.ignore_patterns(_MARKER)
    shutil.copytree(source, target, dirs_exist_ok=True, symlinks=True, ignore=ignore)
    if os.geteuid() == 0:
        for folder, dirs, files in os.walk(target):
            for name in [*dirs, *files]:
                os.lchown(os.path.join(folder, name), sandbox.uid, sandbox.uid)
