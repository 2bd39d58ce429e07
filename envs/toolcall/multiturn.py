"""BFCL's stateful multi-turn backends (file system, messaging, trading, travel, ...) run
inside a sandbox, because they evaluate call strings with `eval`.

The sandbox gets one read-only zip (`/opt/bfcl/bundle.zip`): bfcl-eval's multi-turn
modules, mpmath (the math backend's one dependency), and `envs/toolcall/bfcl_runner.py` as
its `__main__`, each module also precompiled so that imports need no compiling. The
sandbox's own `python3` runs it; nothing of the host's virtual environment is visible
there. Each step replays the episode's earlier calls on fresh backends and executes the
new ones (see the runner's docstring); the grade is BFCL's `multi_turn_checker`, run there
too.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import json
import logging
import marshal
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.sandbox import Sandbox, SandboxConfig, SandboxError, closed_on_failure, make_sandbox
from envs.toolcall.bfcl import Check, package_root

logger = logging.getLogger(__name__)

BUNDLE_DIR = "/opt/bfcl"
BUNDLE = f"{BUNDLE_DIR}/bundle.zip"
_REQUEST = "/workspace/request.json"
_RUNNER = Path(__file__).with_name("bfcl_runner.py")
# bfcl-eval's files the backends and the checker import (paths under the package).
_BFCL_FILES = (
    "__init__.py",
    "constants/__init__.py",
    "constants/executable_backend_config.py",
    "eval_checker/__init__.py",
    "eval_checker/multi_turn_eval/__init__.py",
    "eval_checker/multi_turn_eval/multi_turn_utils.py",
    "eval_checker/multi_turn_eval/multi_turn_checker.py",
    "eval_checker/multi_turn_eval/func_source_code/__init__.py",
    "eval_checker/multi_turn_eval/func_source_code/long_context.py",
    "eval_checker/multi_turn_eval/func_source_code/gorilla_file_system.py",
    "eval_checker/multi_turn_eval/func_source_code/math_api.py",
    "eval_checker/multi_turn_eval/func_source_code/message_api.py",
    "eval_checker/multi_turn_eval/func_source_code/posting_api.py",
    "eval_checker/multi_turn_eval/func_source_code/ticket_api.py",
    "eval_checker/multi_turn_eval/func_source_code/trading_bot.py",
    "eval_checker/multi_turn_eval/func_source_code/travel_booking.py",
    "eval_checker/multi_turn_eval/func_source_code/vehicle_control.py",
)


@functools.cache
def bundle() -> bytes:
    """The zip the sandbox runs (built once per process)."""
    sources: dict[str, bytes] = {"__main__.py": _RUNNER.read_bytes()}
    root = package_root()
    for name in _BFCL_FILES:
        sources[f"bfcl_eval/{name}"] = (root / name).read_bytes()
    spec = importlib.util.find_spec("mpmath")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("mpmath is not installed (BFCL's math backend needs it)")
    mpmath = Path(spec.origin).parent
    for path in sorted(mpmath.rglob("*.py")):
        sources[f"mpmath/{path.relative_to(mpmath).as_posix()}"] = path.read_bytes()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, source in sources.items():
            archive.writestr(name, source)
            if name != "__main__.py":
                archive.writestr(name + "c", _pyc(source, name))
    return buffer.getvalue()


def _pyc(source: bytes, name: str) -> bytes:
    """Unchecked-hash bytecode: zipimport loads it without the source's mtime, and falls
    back to the source when the sandbox's Python has another magic number."""
    code = compile(source, name, "exec", dont_inherit=True)
    flags = (0b01).to_bytes(4, "little")  # hash-based, unchecked (PEP 552)
    return importlib.util.MAGIC_NUMBER + flags + bytes(8) + marshal.dumps(code)


@dataclass(frozen=True)
class BackendEntry:
    """What the backends need of a multi-turn item."""

    item_id: str
    initial_config: Mapping[str, Any]
    involved_classes: tuple[str, ...]

    def request(self) -> dict[str, Any]:
        return {
            "id": self.item_id,
            "initial_config": self.initial_config,
            "involved_classes": list(self.involved_classes),
        }


class BackendSandbox:
    """One episode's sandbox for BFCL's backends.

    Args:
        backend: the sandbox backend ("auto", "bwrap" or "docker").
        timeout: seconds one step (replay included) may run.
    """

    def __init__(self, backend: str = "bwrap", timeout: float = 60.0):
        config = SandboxConfig(readonly=(BUNDLE_DIR,), timeout=timeout, memory_mb=1024)
        self.timeout = timeout
        with closed_on_failure(make_sandbox(backend, config)) as sandbox:
            sandbox.start()
            sandbox.write_file(BUNDLE, bundle())
        self.sandbox: Sandbox = sandbox

    def execute(
        self, entry: BackendEntry, history: Sequence[Sequence[str]], calls: Sequence[str]
    ) -> list[str]:
        """The results of `calls` after replaying `history`; errors as BFCL writes them."""
        request = {"op": "execute", "entry": entry.request(), "history": history, "calls": calls}
        try:
            answer = self._run(request)
        except SandboxError as error:
            return [f"Error during execution: {error}" for _ in calls]
        return [str(result) for result in answer["results"]]

    def grade(
        self, entry: BackendEntry, decoded: Sequence[Sequence[Sequence[str]]], ground_truth: Any
    ) -> Check:
        """BFCL's `multi_turn_checker` verdict on the episode's calls, turn by turn."""
        request = {
            "op": "grade",
            "entry": entry.request(),
            "decoded": decoded,
            "ground_truth": ground_truth,
        }
        try:
            answer = self._run(request)
        except SandboxError as error:
            return Check(False, "multi_turn:sandbox_error", str(error))
        return Check(bool(answer["valid"]), answer["error_type"], answer["error_message"])

    def _run(self, request: Mapping[str, Any]) -> dict[str, Any]:
        self.sandbox.write_file(_REQUEST, json.dumps(request))
        result = self.sandbox.exec(f"python3 {BUNDLE} {_REQUEST}", timeout=self.timeout)
        if result.timed_out or result.exit_code != 0:
            reason = "timed out" if result.timed_out else f"exit code {result.exit_code}"
            raise SandboxError(f"the backends failed ({reason}): {result.stderr[-2000:]}")
        try:
            answer: dict[str, Any] = json.loads(result.stdout)
        except json.JSONDecodeError as error:
            raise SandboxError(f"the backends answered no JSON: {result.stdout[:200]!r}") from error
        return answer

    def close(self) -> None:
        self.sandbox.close()
