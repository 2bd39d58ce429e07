"""The Docker backend: a container per sandbox through the Docker Engine's `docker` SDK.

What it isolates:
- network: `--network none`, only a loopback device of its own; neither the internet nor
  the host's loopback services are reachable;
- file system: the container's own root from a locally built base image (debootstrap +
  `docker import`, never pulled); nothing of the host is mounted, so writes anywhere stay
  in the container's layer and vanish when it is removed;
- processes: a pid namespace with an init that reaps orphans; every process ends when the
  container is removed on `close`, and a reaper removes containers whose parent process
  died without closing them (they are labelled with the parent's boot id, pid and start);
- resources: memory (swap included), pids and CPU limits of the container's cgroup,
  rlimits on file size and CPU seconds per process,
  no capabilities beyond file ownership and signals, `no-new-privileges`;
- disk: the container's writable layer (every file it wrote or changed, anywhere: /tmp,
  the workspace, /root) is held to `disk_mb` and `max_files`, measured from the host in
  overlay2's upper directory (see shell.py for how commands are stopped); `--storage-opt
  size=` would need overlay2 on XFS with project quotas, and a tmpfs over the workspace
  would hide the image's tree there (a SWE project's /testbed).

What it does not isolate:
- the kernel is shared with the host (containers are not VMs);
- the agent is root inside its container, so the `readonly` directories are only
  read-only by convention: graders wipe and rewrite them before use;
- the disk budget where the layer cannot be walked from here (not root, another storage
  driver than overlay2, a daemon on another machine): then only the per-file rlimit holds;
- /dev/shm, Docker's 64 MB tmpfs, is memory rather than disk and outside the budget;
- the daemon itself: whoever can reach its socket controls the host.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import selectors
import socket
import tarfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from envs.sandbox.base import Sandbox
from envs.sandbox.cleanup import LABEL, OWNER_LABEL, owner_label, reap_docker_orphans
from envs.sandbox.limits import disk_usage, refused_forks
from envs.sandbox.processes import kill
from envs.sandbox.records import DiskUsage, SandboxConfig, SandboxError
from envs.sandbox.shell import STDERR, STDOUT, ShellChannel
from envs.sandbox.trees import clean_archive

logger = logging.getLogger(__name__)

SUITE = "bookworm"
# Keep in sync with scripts/docker_base_image.sh: the image tag is their hash.
BASE_PACKAGES = (
    "bash,coreutils,findutils,grep,sed,gawk,diffutils,procps,psmisc,file,bc,jq,tree,less,lsof,"
    "hashdeep,zip,unzip,bzip2,xz-utils,gzip,tar,cpio,python3,python3-pytest,git,ca-certificates"
)
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_CAPS = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID"]
_KILL = (
    "for d in /proc/[0-9]*; do p=${d#/proc/}; "
    'case $p in 1|$$|"$1"|"$2") ;; *) kill -9 "$p" 2>/dev/null;; esac; done; true'
)
"""Kills every process of the container but its init, the keep-alive whose pid is `$2` (the
container ends with it), the shell whose pid is `$1` and itself. The keep-alive's pid is
read once, when the container starts and nothing else runs: found later by its name or as
the init's lowest-numbered child, an agent's process named `sleep`, or an orphan whose pid
wrapped around below it, would be spared."""
_KEEPALIVE_WAIT_S = 10.0
"""How long a new container's init may take to fork its keep-alive."""
_RESIDENTS = 3  # tasks of an idle container: its init, the keep-alive and the shell
_reaped = threading.Event()
_unmeasured = threading.Event()  # set once the disk budget was said to be unenforced


def base_image_tag() -> str:
    """The tag `scripts/docker_base_image.sh` gives the base image."""
    digest = hashlib.sha256(f"{SUITE} {BASE_PACKAGES}".encode()).hexdigest()[:12]
    return f"clawgym/sandbox-base:{digest}"


def docker_answers(timeout: float = 2.0) -> bool:
    """Whether a Docker daemon answers a ping now (false at once when no socket exists)."""
    if not os.environ.get("DOCKER_HOST") and not os.path.exists("/var/run/docker.sock"):
        return False
    try:
        import docker

        client = docker.from_env(timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # any failure to talk to it means "no daemon" here
        return False


def _spared(host_pids: list[str], keep: str, keepalive: str) -> set[str]:
    """Host pids of the container's init and the processes whose pids inside the container
    are `keep` (the shell) and `keepalive` (the init's `sleep infinity`)."""
    spared = set()
    for pid in host_pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if (fields.get("NSpid", "").split()[-1:] or [""])[0] in ("1", keep, keepalive):
            spared.add(pid)
    return spared


def _writable_layer(attrs: dict[str, Any]) -> Path | None:
    """The host directory of a container's writable layer (overlay2's upper directory)
    where this process can walk it: as root, with the daemon on this machine. None
    elsewhere, and the disk budget is not enforced (said once)."""
    data = (attrs.get("GraphDriver") or {}).get("Data") or {}
    upper = data.get("UpperDir")
    if upper and os.geteuid() == 0 and os.path.isdir(upper):
        return Path(upper)
    if not _unmeasured.is_set():
        _unmeasured.set()
        logger.warning(
            "docker sandboxes' disk budget is not enforced: their writable layer (%s) cannot "
            "be walked from here (run as root, with overlay2, on the daemon's machine)",
            upper or "no overlay2 upper directory",
        )
    return None


def _read_ahead(raw: Any, sock: socket.socket) -> bytes:
    """The stream's first bytes where the SDK's HTTP client read them into its buffer with
    the upgrade's headers: on a busy machine the daemon's answer and the shell's first
    output arrive in one piece, and reading the socket alone would lose them (the shell's
    pid line among them, so the sandbox would wait for a shell that had already spoken)."""
    response = getattr(raw, "_response", None)  # the SDK keeps it there (unix sockets)
    reader = getattr(getattr(getattr(response, "raw", None), "_fp", None), "fp", None)
    if reader is None or not hasattr(reader, "read1"):
        return b""
    timeout = sock.gettimeout()
    sock.setblocking(False)  # what is buffered, or what the socket holds now: never a wait
    try:
        return reader.read1(1 << 16) or b""
    except (OSError, ValueError):
        return b""
    finally:
        sock.settimeout(timeout)


class SocketChannel(ShellChannel):
    """A shell reached through a hijacked `docker exec` socket (multiplexed streams)."""

    def __init__(self, raw: Any):
        # The SDK hands back a socket wrapper; the wrapper is kept for as long as the
        # channel lives, because collecting it closes the socket under us.
        self.raw = raw
        self.sock: socket.socket = getattr(raw, "_sock", raw)
        self.buffer = bytearray(_read_ahead(raw, self.sock))
        self.eof = False
        # epoll, not select(): a process holding a thousand files (a long test session,
        # a trainer) gets socket numbers past select()'s limit of 1024
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.sock, selectors.EVENT_READ)

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError as error:
            raise SandboxError(f"the shell is gone ({error})") from None

    def read(self, timeout: float) -> list[tuple[int, bytes]] | None:
        chunks = self._frames()
        if chunks or self.eof:
            return chunks or None
        try:
            ready = self._selector.select(max(0.0, timeout))
            data = self.sock.recv(1 << 16) if ready else None
        except (OSError, ValueError) as error:  # the socket broke, or close() ran meanwhile
            logger.debug("docker shell socket: %s", error)
            data = b""
        if data == b"":
            self.eof = True
        elif data:
            self.buffer += data
        chunks = self._frames()
        return None if self.eof and not chunks else chunks

    def _frames(self) -> list[tuple[int, bytes]]:
        chunks = []
        while len(self.buffer) >= 8:
            size = int.from_bytes(self.buffer[4:8], "big")
            if len(self.buffer) < 8 + size:
                break
            stream = STDERR if self.buffer[0] == 2 else STDOUT
            chunks.append((stream, bytes(self.buffer[8 : 8 + size])))
            del self.buffer[: 8 + size]
        return chunks

    def close(self) -> None:
        self._selector.close()
        for closable in (self.raw, self.sock):
            try:
                closable.close()
            except OSError:
                pass


class DockerSandbox(Sandbox):
    """A container sandbox; see the module docstring for what it does and does not isolate.

    Args:
        config: paths and limits.
        image: the image to run; by default the locally built base image.
    """

    backend = "docker"

    def __init__(self, config: SandboxConfig | None = None, image: str | None = None):
        super().__init__(config or SandboxConfig())
        import docker
        from docker.errors import DockerException, ImageNotFound

        try:
            self.client = docker.from_env(timeout=60)
            if not _reaped.is_set():
                _reaped.set()
                reap_docker_orphans(self.client)
        except DockerException as error:
            raise SandboxError(f"no Docker daemon answers: {error}") from None
        self.image = image or base_image_tag()
        try:
            self.container = self.client.containers.run(self.image, **self._run_options())
        except ImageNotFound:
            raise SandboxError(
                f"image {self.image} is not built; run scripts/docker_base_image.sh as root"
            ) from None
        except DockerException as error:
            raise SandboxError(f"cannot start a container: {error}") from None
        self._shell_pid = "0"
        self._exec_id = ""
        self._pids_group = self._find_pids_cgroup()
        self._layer = _writable_layer(self.container.attrs)
        self._keepalive = self._keepalive_pid()

    def _keepalive_pid(self) -> str:
        """The keep-alive's pid inside the container, read while it is the init's only child
        (a `docker exec` is a child of no process in there). The container runs before its
        init has forked the keep-alive: on a busy machine the first look can find no child,
        so it looks again for up to `_KEEPALIVE_WAIT_S`."""
        deadline = time.monotonic() + _KEEPALIVE_WAIT_S
        while True:
            try:
                code, output = self.container.exec_run(["cat", "/proc/1/task/1/children"])
            except Exception as error:
                self.container.remove(force=True)
                raise SandboxError(f"the container did not start: {error}") from None
            children = output.decode(errors="replace").split()
            if code == 0 and len(children) == 1 and children[0].isdigit():
                return children[0]
            if code != 0 or children or time.monotonic() > deadline:
                self.container.remove(force=True)
                raise SandboxError(f"the container's keep-alive was not found: {output[:200]!r}")
            time.sleep(0.05)

    def _run_options(self) -> dict[str, Any]:
        from docker.types import Ulimit

        config = self.config
        memory = f"{config.memory_mb}m"
        file_size = config.max_file_mb * 1024 * 1024
        return {
            "command": ["sleep", "infinity"],
            "detach": True,
            "init": True,
            "network_mode": "none",
            "mem_limit": memory,
            "memswap_limit": memory,
            "pids_limit": config.max_procs,
            "nano_cpus": int(config.cpus * 1e9),
            "ulimits": [
                Ulimit(name="fsize", soft=file_size, hard=file_size),
                Ulimit(name="cpu", soft=config.cpu_seconds, hard=config.cpu_seconds),
                Ulimit(name="core", soft=0, hard=0),
            ],
            "cap_drop": ["ALL"],
            "cap_add": _CAPS,
            "security_opt": ["no-new-privileges"],
            "hostname": "sandbox",
            "labels": {LABEL: "1", OWNER_LABEL: owner_label()},
            "environment": self._environment(),
        }

    def _environment(self) -> dict[str, str]:
        env = {"PATH": _PATH, "HOME": "/root", "LANG": "C.UTF-8", "TERM": "dumb"}
        return {**env, **dict(self.config.env)}

    # -- Sandbox hooks -------------------------------------------------------------------
    def _open_shell(self) -> ShellChannel:
        self._check_open()
        api = self.client.api
        exec_id = api.exec_create(
            self.container.id,
            ["/bin/sh", "-c", "echo $$; exec /bin/bash --noprofile --norc"],
            stdin=True,
            stdout=True,
            stderr=True,
            tty=False,
            environment=self._environment(),
            workdir="/",
        )["Id"]
        self._exec_id = exec_id
        raw = api.exec_start(exec_id, socket=True)
        channel = SocketChannel(raw)
        self._shell_pid = self._first_line(channel)
        return channel

    @staticmethod
    def _first_line(channel: SocketChannel) -> str:
        received = b""
        deadline = time.monotonic() + 30
        while b"\n" not in received and time.monotonic() < deadline:
            chunks = channel.read(1.0)
            if chunks is None:
                break
            received += b"".join(data for stream, data in chunks if stream == STDOUT)
        line, _, rest = received.partition(b"\n")
        if not line.strip().isdigit() or rest:
            raise SandboxError(f"the container's shell did not start: {received[:200]!r}")
        return line.strip().decode()

    def _kill_processes(self, keep_shell: bool) -> None:
        if self._closed:
            return
        if keep_shell and self._process_count() == _RESIDENTS:
            return  # nothing runs but them: spares a `docker exec` per command without root
        keep = self._shell_pid if keep_shell else "0"
        if self._kill_from_host(keep):
            return
        try:
            self.container.exec_run(["/bin/sh", "-c", _KILL, "sh", keep, self._keepalive])
        except Exception as error:  # the container may be gone already
            logger.debug("kill in %s failed: %s", self.container.name, error)

    def _kill_from_host(self, keep: str) -> bool:
        """Kills from the host, through the container's cgroup: no process has to start in
        a container that may be at its pids limit (a fork bomb). False where the cgroup
        cannot be read (then the kill runs inside the container)."""
        group = self._pids_group
        if group is None or os.geteuid() != 0:
            return False
        try:
            members = (group / "cgroup.procs").read_text().split()
        except OSError:
            return False
        spared = _spared(members, keep, self._keepalive)
        for _ in range(3):  # a bomb forks while it is being killed
            kill(int(pid) for pid in members if pid not in spared)
            try:
                members = (group / "cgroup.procs").read_text().split()
            except OSError:
                break
        return True

    def _find_pids_cgroup(self) -> Path | None:
        """The running container's pids cgroup directory on the host (cgroup v1 or v2,
        cgroupfs or systemd driver); None where it cannot be seen from here."""
        cid = self.container.id
        candidates = [
            Path(f"/sys/fs/cgroup/pids/docker/{cid}"),
            Path(f"/sys/fs/cgroup/docker/{cid}"),
            Path(f"/sys/fs/cgroup/system.slice/docker-{cid}.scope"),
        ]
        return next((c for c in candidates if (c / "pids.current").exists()), None)

    def _process_count(self) -> int | None:
        group = self._pids_group
        try:
            return None if group is None else int((group / "pids.current").read_text())
        except (OSError, ValueError):
            return None

    def _process_limit_hits(self) -> int | None:
        group = self._pids_group
        return None if group is None else refused_forks(group)

    def _shell_status(self) -> int | None:
        try:
            for _ in range(20):
                state = self.client.api.exec_inspect(self._exec_id)
                if not state.get("Running"):
                    return state.get("ExitCode")
                time.sleep(0.01)
        except Exception:  # the exec or its container is gone
            return None
        return None

    def _disk_usage(self) -> DiskUsage | None:
        return None if self._layer is None else disk_usage([self._layer])

    def _release(self) -> None:
        try:
            self.container.remove(force=True)
        except Exception as error:  # already removed (by the reaper, or by hand)
            logger.debug("remove %s: %s", self.container.name, error)
        finally:
            self.client.close()

    # -- files ---------------------------------------------------------------------------
    def write_file(self, path: str, data: bytes | str) -> None:
        self._check_open()
        payload = data.encode() if isinstance(data, str) else data
        absolute = self._absolute(path)
        parent = os.path.dirname(absolute)
        with _sdk_errors(f"cannot write {path}"):
            code, output = self.container.exec_run(["mkdir", "-p", "--", parent])
            if code != 0:
                reason = output.decode(errors="replace").strip()
                raise SandboxError(f"cannot write {path}: {reason}")
            archive = io.BytesIO()
            with tarfile.open(fileobj=archive, mode="w") as tar:
                info = tarfile.TarInfo(os.path.basename(absolute))
                info.size, info.mode, info.mtime = len(payload), 0o644, int(time.time())
                tar.addfile(info, io.BytesIO(payload))
            if not self.container.put_archive(parent, archive.getvalue()):
                raise SandboxError(f"cannot write {path}")

    def read_file(self, path: str) -> bytes:
        self._check_open()
        limit = self.config.max_read_mb * 1024 * 1024
        # head runs inside the container: links resolve in its file system, never the
        # host's; `test -f` first, as a fifo the agent left would block `head` forever
        with _sdk_errors(f"cannot read {path}"):
            code, (out, err) = self.container.exec_run(
                [
                    "/bin/sh",
                    "-c",
                    'test -f "$1" || { echo "it is not a regular file" >&2; exit 1; }; '
                    'exec timeout 60 head -c "$2" -- "$1"',
                    "sh",
                    self._absolute(path),
                    str(limit + 1),
                ],
                demux=True,
            )
        if code != 0:
            reason = (err or b"").decode(errors="replace").strip()
            raise SandboxError(f"cannot read {path}: {reason}")
        data = out or b""
        if len(data) > limit:
            raise SandboxError(f"{path} is larger than {self.config.max_read_mb} MB")
        return data

    # -- trees ---------------------------------------------------------------------------
    def _export_tree(self, path: str) -> bytes:
        from docker.errors import NotFound

        # the daemon makes the archive from the container's file system: nothing of the
        # agent's runs, and its links are recorded rather than followed
        absolute = self._absolute(path).rstrip("/") or "/"
        try:
            with _sdk_errors(f"cannot export {path}"):
                stream, _ = self.container.get_archive(absolute)
                return clean_archive(stream, path, strip=1)
        except SandboxError as error:
            if isinstance(error.__cause__, NotFound):
                return clean_archive([], path)
            raise

    def _import_tree(self, path: str, archive: bytes) -> None:
        absolute = self._absolute(path)
        with _sdk_errors(f"cannot import into {path}"):
            code, output = self.container.exec_run(["mkdir", "-p", "--", absolute])
            if code != 0 or not self.container.put_archive(absolute, archive):
                raise SandboxError(f"cannot import into {path}: {output.decode().strip()}")

    def _absolute(self, path: str) -> str:
        if ".." in path.split("/"):
            raise SandboxError(f"{path}: '..' is not allowed in file paths")
        return path if path.startswith("/") else f"{self._cwd.rstrip('/')}/{path}"


@contextmanager
def _sdk_errors(what: str) -> Iterator[None]:
    """The Docker SDK's errors (a name too long, a path under /proc, a container gone) as
    the `SandboxError` that tools turn into an observation for the agent."""
    from docker.errors import DockerException
    from requests.exceptions import RequestException

    try:
        yield
    except (DockerException, RequestException) as error:
        explanation = getattr(error, "explanation", None) or str(error)
        raise SandboxError(f"{what}: {explanation}") from error
