"""Sandboxes for agents' commands: one interface (`base.Sandbox`), two backends
(`bwrap`, `docker`), and `make_sandbox` to pick one by name ("auto": docker when a daemon
answers, else bwrap)."""

from envs.sandbox.base import (
    ExecResult,
    Sandbox,
    SandboxClosed,
    SandboxConfig,
    SandboxError,
    closed_on_failure,
)
from envs.sandbox.factory import SandboxPool, make_sandbox, resolve_backend

__all__ = [
    "ExecResult",
    "Sandbox",
    "SandboxClosed",
    "SandboxConfig",
    "SandboxError",
    "SandboxPool",
    "closed_on_failure",
    "make_sandbox",
    "resolve_backend",
]
