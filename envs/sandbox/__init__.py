"""Sandboxes for agents' commands: one interface (`base.Sandbox`), two backends
(`bwrap`, `docker`), and `make_sandbox` to pick one by name ("auto": docker when a daemon
answers, else bwrap)."""

from envs.sandbox.base import Sandbox, closed_on_failure
from envs.sandbox.cleanup import close_held
from envs.sandbox.factory import SandboxPool, make_sandbox, resolve_backend
from envs.sandbox.records import ExecResult, SandboxClosed, SandboxConfig, SandboxError

__all__ = [
    "ExecResult",
    "Sandbox",
    "SandboxClosed",
    "SandboxConfig",
    "SandboxError",
    "SandboxPool",
    "close_held",
    "closed_on_failure",
    "make_sandbox",
    "resolve_backend",
]
