"""What a sandbox is given and gives back: its `SandboxConfig` (paths and limits), the
`ExecResult` of a command, the `DiskUsage` of its files against the budget, and the errors
every sandbox operation raises (`SandboxError`, written for the agent to read)."""

from __future__ import annotations

from dataclasses import dataclass

_MB = 1024 * 1024


class SandboxError(RuntimeError):
    """A sandbox operation failed; the message is written for the agent to read."""


class SandboxClosed(SandboxError):
    """The sandbox was closed (possibly while a command ran)."""


@dataclass(frozen=True)
class SandboxConfig:
    """What a sandbox looks like from inside and what it may use.

    Attributes:
        workdir: the shell's starting directory.
        writable: directories the agent may write (besides a private /tmp).
        readonly: directories the host fills and the agent may only read (e.g. tests).
        env: extra environment variables of the shell.
        timeout: default seconds a command may run.
        max_output: bytes kept per stream of one command; the rest is dropped, visibly.
        memory_mb: memory of the whole sandbox.
        max_procs: processes and threads of the whole sandbox.
        cpus: CPU cores' worth of time the sandbox may use.
        cpu_seconds: CPU time of any one process before the kernel kills it.
        max_file_mb: largest file a process may write.
        max_read_mb: largest file `read_file` returns.
        disk_mb: bytes the sandbox's files may take on disk in all (see the module
            docstring); a gigabyte holds any task's tree and build outputs many times over.
        max_files: files, directories and links the sandbox's files may count; 100,000
            holds a large project with its git objects (a SWE workspace holds thousands).
        keep_background: let processes a command leaves running live on into the next
            commands; by default each command starts with none but the shell.
    """

    workdir: str = "/workspace"
    writable: tuple[str, ...] = ("/workspace",)
    readonly: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    timeout: float = 30.0
    max_output: int = 64 * 1024
    memory_mb: int = 1024
    max_procs: int = 256
    cpus: float = 1.0
    cpu_seconds: int = 600
    max_file_mb: int = 256
    max_read_mb: int = 64
    disk_mb: int = 1024
    max_files: int = 100_000
    keep_background: bool = False

    def __post_init__(self) -> None:
        for path in (self.workdir, *self.writable, *self.readonly):
            if not path.startswith("/") or ".." in path.split("/"):
                raise ValueError(f"sandbox paths must be absolute without '..', got {path!r}")
        for path in (*self.writable, *self.readonly):
            if path in ("/", "/tmp", "/proc", "/dev", "/usr", "/etc"):
                raise ValueError(f"{path!r} cannot be a sandbox mount; use a directory of its own")
        numbers = {
            "timeout": self.timeout,
            "max_output": self.max_output,
            "memory_mb": self.memory_mb,
            "max_procs": self.max_procs,
            "cpus": self.cpus,
            "cpu_seconds": self.cpu_seconds,
            "max_file_mb": self.max_file_mb,
            "max_read_mb": self.max_read_mb,
            "disk_mb": self.disk_mb,
            "max_files": self.max_files,
        }
        for name, value in numbers.items():
            if value <= 0:
                raise ValueError(f"SandboxConfig.{name} must be positive, got {value}")
        if self.max_output < 256:
            raise ValueError(f"max_output must be at least 256 bytes, got {self.max_output}")


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one command.

    Attributes:
        exit_code: the command's status; 124 when it timed out.
        stdout: its standard output (decoded, invalid UTF-8 replaced).
        stderr: its standard error.
        timed_out: it was killed for running past its timeout.
        stdout_omitted: bytes of stdout the output cap dropped (a marker shows where).
        stderr_omitted: bytes of stderr the output cap dropped.
        shell_restarted: the shell was replaced after this command (it exited or hung);
            the working directory and exported variables were restored, the rest was not.
    """

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    stdout_omitted: int = 0
    stderr_omitted: int = 0
    shell_restarted: bool = False

    @property
    def truncated(self) -> bool:
        """Whether the output cap dropped anything."""
        return bool(self.stdout_omitted or self.stderr_omitted)


@dataclass(frozen=True)
class DiskUsage:
    """What a sandbox's files take on the host's disk.

    Attributes:
        bytes: bytes of allocated blocks (a sparse file counts what it uses; a file with
            several links counts once).
        files: files, directories and links.
    """

    bytes: int
    files: int

    def over(self, config: SandboxConfig) -> bool:
        """Whether this is past the budget of `config`."""
        return self.bytes > config.disk_mb * _MB or self.files > config.max_files

    def grew_past(self, start: DiskUsage, config: SandboxConfig) -> bool:
        """Whether a command that began at `start` pushed the bytes or the files up and
        past the budget; one that only deletes never did, so an agent over budget can
        always clean up."""
        return self.bytes > max(start.bytes, config.disk_mb * _MB) or self.files > max(
            start.files, config.max_files
        )

    def note(self, config: SandboxConfig, stopped: bool) -> str:
        """What the agent reads when this is over the budget."""
        used = f"{self.bytes / _MB:.0f} MB in {self.files} files"
        budget = f"{config.disk_mb} MB and {config.max_files} files"
        if stopped:
            return (
                f"\n[error] the command was stopped: the sandbox's files ({used}) grew past "
                f"its disk budget of {budget}; delete files to go on\n"
            )
        return (
            f"\n[error] the sandbox's files ({used}) are over its disk budget of {budget}; "
            "a command that adds files is stopped until enough are deleted\n"
        )
