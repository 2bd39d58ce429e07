"""Where the local learner's model lives and what memory it may use: the base model on its
device and dtype with a peft LoRA adapter (`lora_model`, on the modules `lora_targets`
picks), the activations' estimate that turns gradient checkpointing on per pass
(`activation_bytes` against `available_memory`), glibc's mmap threshold
(`set_mmap_threshold`), and the OpenMP workers a step leaves behind
(`release_openmp_workers`).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from agents import models
from trainers.config import TrainerConfig


def lora_model(model_name: str, config: TrainerConfig) -> tuple[Any, torch.device]:
    """The base model `model_name` on the learner's device (`trainer.device`) and dtype
    (`trainer.dtype`), with a fresh LoRA adapter of `trainer.lora_rank` on
    `trainer.target_modules`; and the device."""
    from peft import LoraConfig, get_peft_model

    if config.mmap_threshold_kb:
        set_mmap_threshold(config.mmap_threshold_kb * 1024)
    base, _ = models.load(model_name)
    cuda = torch.cuda.is_available()
    device = torch.device(learner_device(config.device, cuda))
    dtype = learner_dtype(config.dtype, device.type, cuda and torch.cuda.is_bf16_supported())
    base = base.to(device=device, dtype=dtype)
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        target_modules=lora_targets(base, model_name, config),
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    # peft keeps the adapter's weights in float32 under a bf16 base (autocast_adapter_dtype)
    return get_peft_model(base, lora), device


def lora_targets(model: Any, model_name: str, config: TrainerConfig) -> list[str]:
    """The modules a fresh adapter goes on. A text model: `trainer.target_modules`, which
    peft matches as name suffixes. A vision-language model: its linear layers by full name
    (`select_lora_modules`), since suffixes alone reach into the vision tower (Qwen2.5-VL's
    names its MLP gate_proj, up_proj and down_proj too).

    Raises:
        ValueError: `trainer.train_vision_tower` on a model without one.
    """
    if not models.is_vision(model_name):
        if config.train_vision_tower:
            raise ValueError(
                f"trainer.train_vision_tower=true, but {model_name} has no vision tower"
            )
        return list(config.target_modules)
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    names = {id(module): name for name, module in model.named_modules()}
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return select_lora_modules(
        linears,
        language_model=names[id(decoder)],
        head=names.get(id(head)),
        suffixes=config.target_modules,
        vision_tower=config.train_vision_tower,
    )


def select_lora_modules(
    linears: list[str],
    language_model: str,
    head: str | None,
    suffixes: list[str],
    vision_tower: bool,
) -> list[str]:
    """Of a vision-language model's linear layers (full names), those under its language
    model (the module named `language_model`) whose last name is in `suffixes`; with
    `vision_tower`, also every one outside the language model except the output `head`."""

    def in_language_model(name: str) -> bool:
        return name == language_model or name.startswith(language_model + ".")

    chosen = [
        name
        for name in linears
        if (in_language_model(name) and name.rsplit(".", 1)[-1] in suffixes)
        or (vision_tower and not in_language_model(name) and name != head)
    ]
    if not chosen:
        raise ValueError(
            f"no linear layer of the language model ({language_model}) is named one of "
            f"trainer.target_modules {sorted(suffixes)}"
        )
    return chosen


def memory_budget(config: TrainerConfig, device: torch.device) -> int:
    """`gradient_checkpointing=auto`: the activations a pass may keep, in bytes
    (`trainer.memory_budget_gib`, else half the memory available now)."""
    budget = config.memory_budget_gib
    return int(budget * 2**30) if budget is not None else available_memory(device) // 2


def set_mmap_threshold(size: int) -> bool:
    """Fixes glibc's mmap threshold for this process; False where libc is not glibc.

    PyTorch's CPU allocator frees each tensor back to malloc. glibc raises its mmap
    threshold (up to 32 MiB) whenever a mapped block is freed, after which a step's
    activations come from the heap, and a fragmented heap keeps what was freed: a LoRA step
    on SmolLM2 at 8 x 512 tokens peaked at 5.5 GiB RSS that way, 1.45 GiB with the
    threshold fixed at 1 MiB, but took 1.4x as long, every large tensor then being a fresh
    mapping whose pages fault in again (`TrainerConfig.mmap_threshold_kb`). Setting it
    explicitly also turns the adaptation off.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, size)) and bool(mallopt(m_trim_threshold, size))


def activation_bytes(positions: int, model_config: Any, dtype_bytes: int) -> int:
    """Memory autograd keeps for backward over a pass of `positions` positions without
    gradient checkpointing: per layer and position, about 12 hidden-size tensors (norms,
    attention's inputs and outputs, the projections' inputs) and 5 intermediate-size ones
    (the gated MLP's), doubled for what the allocator holds beside them. Calibrated on
    SmolLM2-135M, fp32 on a CPU: 7.4 GiB peak resident for a pass of ~2,000 positions, where
    this says 7.0 GiB (the weights' 0.5 GiB aside)."""
    per_position = 12 * model_config.hidden_size + 5 * model_config.intermediate_size
    return 2 * positions * model_config.num_hidden_layers * per_position * dtype_bytes


def available_memory(device: torch.device) -> int:
    """Bytes free for the learner's activations now: the GPU's free memory, else the
    system's available memory (/proc/meminfo; free pages where there is none)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def learner_device(requested: str, cuda_available: bool) -> str:
    """Where the learner trains: `requested` (auto: cuda when present, else cpu)."""
    if requested == "cuda" and not cuda_available:
        raise ValueError(
            "trainer.device=cuda, but torch sees no CUDA device; use trainer.device=cpu"
        )
    if requested == "auto":
        return "cuda" if cuda_available else "cpu"
    return requested


def learner_dtype(requested: str, device: str, bf16_supported: bool) -> torch.dtype:
    """The base weights' dtype: `requested` (auto: bfloat16 on a GPU that has it, else
    float32; bf16 on this CPU is 50x slower than fp32)."""
    if requested == "auto":
        return torch.bfloat16 if device == "cuda" and bf16_supported else torch.float32
    return torch.bfloat16 if requested == "bfloat16" else torch.float32


def release_openmp_workers() -> bool:
    """Ends the OpenMP workers this thread's torch ops started; False where torch does not
    run on GNU libgomp (which alone frees a single thread's team this way).

    Every thread that runs torch's parallel CPU ops keeps a team of OpenMP workers. While a
    team stands idle, libgomp counts more threads than cores and every other team's workers
    stop spinning between parallel regions: each is put to sleep and woken again, for each
    of the hundreds of regions of a decode step. The embedded engine beside an idle learner
    decoded at 154-158 tokens/s against 202-215 alone (64 rows, SmolLM2-135M, 2 cores), and
    a main job's 500-episode evaluation took 358 s against 250. `omp_pause_resource_all`
    (OpenMP 5.0) frees the calling thread's pool in libgomp; its next parallel op starts a
    new one (a thread creation, microseconds).
    """
    gomp = _libgomp()
    return gomp is not None and gomp.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0


_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t in omp.h


@functools.cache
def _libgomp() -> Any:
    """torch's libgomp as loaded in this process, or None (Linux only: read from the maps)."""
    import ctypes

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "/libgomp" in line}
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)  # the loaded instance: dlopen finds it by its path
            library.omp_pause_resource_all.argtypes = [ctypes.c_int]
            return library
        except (OSError, AttributeError):
            continue
    return None
