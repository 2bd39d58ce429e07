"""The composition root: builds engines, proxies, environments and sampling from their
sub-configs (`agents.config`). `trainers.run`, `agents.serve` and `benchmarks.run` build
their components here and nowhere else; each builder takes only its own sub-config.

    engine = build_engine(config.engine, config.model)
    with serve_policy(engine, store, config.serve, config.model) as (url, proxy):
        ...

The trainer-side components (the learner, the judges, the loops) are built by the trainer's
own composition root, `trainers.compose`, from the engines made here: imports point down
only.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import gymnasium as gym

from agents.api_keys import read_keys
from agents.config import (
    EngineConfig,
    EnvConfig,
    ModelConfig,
    SamplingConfig,
    ServeSection,
    serve_key,
    validate_engine,
    validate_model,
    validate_serve,
)
from agents.engines.base import Engine, SamplingParams
from agents.serving.proxy import LIVE_ENV_ID, Proxy, ProxyConfig
from agents.serving.server import in_thread
from agents.store import Store
from agents.trajectory import TurnType
from agents.vision import ImageLimits

logger = logging.getLogger(__name__)

LEARNER_GPU_SHARE = 0.5
"""vLLM's share of one GPU when the learner trains on the same GPU: SmolLM2-class policies
need a fraction of either half; larger ones set engine.gpu_memory_utilization."""


def split_cpus(cpus: Sequence[int], engine_share: int | None = None) -> tuple[list[int], list[int]]:
    """(learner's, engine's) cores when a learner trains beside a vLLM server on a CPU
    machine: the engine takes `engine_share` cores (default: half, rounded up), the last
    ones, the learner the rest; on a single core both share it."""
    cpus = sorted(cpus)
    if len(cpus) < 2:
        return cpus, cpus
    share = (len(cpus) + 1) // 2 if engine_share is None else engine_share
    share = min(max(share, 1), len(cpus) - 1)
    return cpus[: len(cpus) - share], cpus[len(cpus) - share :]


def place_beside_learner(
    engine: EngineConfig, learner_on_cpu: bool, overlap: bool = True
) -> tuple[list[int] | None, list[int] | None]:
    """(learner's, engine's) cores where a learner computes on this machine's CPUs beside a
    vLLM server: two sets of OpenMP threads on the same cores slow both, so they split them
    (`split_cpus`, the engine taking `engine.threads`); without `overlap` the phases
    alternate, never computing at once, and each takes every core. (None, None): nothing to
    split (another engine, or the learner on a GPU, where vLLM takes `LEARNER_GPU_SHARE` of
    its memory: `build_engine`'s `shares_gpu_with_learner`)."""
    if engine.backend != "vllm" or not learner_on_cpu:
        return None, None
    from agents.engines.vllm_command import own_cpus

    if not overlap:
        return own_cpus(), own_cpus()
    return split_cpus(own_cpus(), engine.threads)


def build_engine(
    engine: EngineConfig,
    model: ModelConfig,
    *,
    shares_gpu_with_learner: bool = False,
    cpus: Sequence[int] | None = None,
    host: str = "127.0.0.1",
    api_key: str | None = None,
) -> Engine:
    """The engine `engine.backend` names, serving `model`.

    Args:
        engine: the engine's config.
        model: the base model it serves.
        shares_gpu_with_learner: a learner trains on the same GPU (vLLM then takes
            `LEARNER_GPU_SHARE` of its memory unless the config says otherwise).
        cpus: vllm on a CPU: the cores it computes on (`split_cpus`); None: every core.
        host, api_key: vllm: where its server listens, and the key it then asks for (a
            replica that a proxy on another node reaches; loopback needs none).
    """
    validate_engine(engine)
    validate_model(model)
    if engine.backend == "embedded":
        from agents.engines.embedded import EmbeddedEngine

        return EmbeddedEngine(
            model.name,
            threads=engine.threads,
            max_batch=engine.max_batch,
            context_length=engine.context_length,
            prefix_cache_tokens=engine.prefix_cache_tokens,
            image_limits=image_limits(model),
            merge_lora=engine.merge_lora,
            share_prefixes=engine.share_prefixes,
        )
    if engine.backend == "vllm":
        return _vllm_engine(engine, model, shares_gpu_with_learner, cpus, host, api_key)
    from agents.engines.remote import RemoteEngine

    assert engine.base_url is not None  # validate_engine requires it
    return RemoteEngine(
        engine.base_url, model.name, api_key=engine.api_key, token_ids=engine.token_ids
    )


def _vllm_engine(
    engine: EngineConfig,
    model: ModelConfig,
    shares_gpu_with_learner: bool,
    cpus: Sequence[int] | None,
    host: str,
    api_key: str | None,
) -> Engine:
    """`build_engine` for `backend=vllm`: on a GPU or, with `cpus`, on a CPU."""
    from agents import models
    from agents.engines.vllm import VLLMEngine

    if models.is_vision(model.name):
        raise ValueError(
            f"engine=vllm takes no images yet and {model.name!r} is a vision-language model: "
            "serve it with engine=embedded (vLLM's Qwen-VL input processing needs "
            "torchvision, which .venv-vllm lacks here, and no image is passed to it)"
        )

    on_gpu = cuda_available()
    usage = engine.gpu_memory_utilization
    if usage is None and on_gpu and shares_gpu_with_learner:
        usage = LEARNER_GPU_SHARE
    return VLLMEngine(
        model.name,
        python=engine.python,
        max_loras=engine.max_loras,
        max_lora_rank=engine.max_lora_rank,
        lora_target_modules=tuple(engine.lora_target_modules),
        max_model_len=engine.context_length or 4096,
        # fp32 on a CPU: bf16 is 50x slower there, and the learner's log-probs match
        dtype=engine.dtype if on_gpu or engine.dtype != "auto" else "float32",
        kv_cache_gib=engine.kv_cache_gib,
        gpu_memory_utilization=usage if on_gpu else None,
        whole_prefills=not on_gpu,
        cpus=None if on_gpu else cpus,
        startup_timeout=engine.startup_timeout,
        host=host,
        api_key=api_key,
    )


def build_tinker_engine(
    service: Any, base_model: str, model: ModelConfig, context_length: int | None = None
) -> Engine:
    """The engine sampling from a Tinker service (`tinker.ServiceClient`, which it closes):
    `base_model` is the service's name of `model`; `context_length` None: the model's own."""
    from agents import models
    from agents.engines.tinker import TinkerEngine

    if context_length is None:
        from transformers import AutoConfig

        resolved = AutoConfig.from_pretrained(models.resolve(model.name))
        context_length = int(resolved.max_position_embeddings)
    tokenizer = models.load_tokenizer(model.name)
    return TinkerEngine(service, base_model, tokenizer, context_length, owns_service=True)


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (False where torch is not installed)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def image_limits(model: ModelConfig) -> ImageLimits:
    """What one request to `model` may carry: the one reading of `model.max_image_bytes`
    and `model.max_images`, for the proxy and the engine alike."""
    validate_model(model)
    return ImageLimits(model.max_image_bytes, model.max_images)


def proxy_config(serve: ServeSection, model: ModelConfig, env_id: str = LIVE_ENV_ID) -> ProxyConfig:
    """The proxy's own config from the `serve` section and the model's image limits;
    `env_id` labels the sessions its clients open by their first request."""
    limits = image_limits(model)
    return ProxyConfig(
        model_name=model.name,
        env_id=env_id,
        api_key=serve_key(serve),
        user_keys=read_keys(serve.api_keys, serve.api_keys_file, "serve.api_keys"),
        admin_key=serve.admin_key or os.environ.get("CLAWGYM_ADMIN_KEY") or None,
        default_turn_type=TurnType(serve.turn_type),
        max_tokens=serve.max_tokens,
        session_idle_s=serve.session_idle_s,
        idle_timeout_s=serve.idle_timeout_s,
        request_timeout_s=serve.request_timeout_s,
        top_logprobs=serve.top_logprobs,
        max_image_bytes=limits.max_bytes,
        max_images=limits.max_images,
    )


@contextlib.contextmanager
def serve_policy(
    engine: Engine,
    store: Store,
    serve: ServeSection,
    model: ModelConfig,
    env_id: str = LIVE_ENV_ID,
) -> Iterator[tuple[str, Proxy]]:
    """Serves `engine` behind the token-exact proxy from a thread of this process, on
    `serve.host:serve.port` (port 0: any free one); yields its base URL and the proxy (its
    `admin_key` is what the admin routes take: `ProxySeat(..., admin_key=proxy.admin_key)`)."""
    validate_serve(serve)
    config = proxy_config(serve, model, env_id)
    with in_thread(engine, store, config, serve.host, serve.port) as (url, proxy):
        logger.info("serving the policy at %s (model `policy`; `base` is the adapter off)", url)
        yield url, proxy


def env_factory(env: EnvConfig) -> Callable[[], gym.Env[Any, Any]]:
    """Makes one instance of the configured environment per call."""
    import envs  # noqa: F401  (registers the clawgym/ environments)

    def make() -> gym.Env[Any, Any]:
        return gym.make(env.id, **env.kwargs)

    return make


def sampling_params(sampling: SamplingConfig, seed: int | None = None) -> SamplingParams:
    """One turn's sampling from the config."""
    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_tokens,
        seed=seed,
    )
