"""Typed configs of the serving side, shared by every entry point through one Hydra tree.

`agents/conf/` holds the groups every entry point composes (`model/`, `engine/`, `env/`)
and the root of `python -m agents.serve`; `trainers/conf/` and `benchmarks/conf/` add their
own groups on top of it (their root configs put `pkg://agents.conf` on Hydra's search
path). `agents.compose` builds components from these sub-configs, each from its own.
Every field has a one-line doc; each `validate_*` raises a ValueError that says the fix.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from typing import Any

from agents.api_keys import read_keys

ENGINE_BACKENDS = ("embedded", "vllm", "remote")
PREFIX_CACHE_TOKENS = 16384
"""The embedded engine's default prefix-cache bound: 720 MiB of SmolLM2-135M's fp32 KV."""
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every projection of a decoder layer: the modules LoRA targets by default."""
MAX_IMAGE_BYTES = 4 << 20
"""The largest image (decoded) one request may carry, unless `model.max_image_bytes` says."""
MAX_IMAGES = 16
"""The most images one request may carry, unless `model.max_images` says."""


@dataclass
class ModelConfig:
    """The policy's base model."""

    name: str = "smollm2-135m"
    """A name `agents.models.resolve` knows (tiny, tiny-vl, smollm2-135m), a directory or a
    hub id."""
    max_image_bytes: int = MAX_IMAGE_BYTES
    """A vision-language model's largest image (decoded) in one request: the proxy answers
    a larger one with a 400 (`invalid_image`), the engine refuses it, and in a run the
    episode that sent it ends failed with the reason."""
    max_images: int = MAX_IMAGES
    """The most images one request's messages may carry (a GUI episode's history holds a
    screenshot a turn: env.gui.kwargs.max_turns up to this plays whole)."""


def validate_model(model: ModelConfig) -> None:
    """Raises ValueError, saying the fix, for image limits that admit nothing."""
    if model.max_image_bytes < 1 or model.max_images < 1:
        raise ValueError(
            f"model.max_image_bytes and model.max_images must be >= 1, got "
            f"{model.max_image_bytes} and {model.max_images}"
        )


@dataclass
class EngineConfig:
    """How the policy is served (agents/engines/)."""

    backend: str = "embedded"
    """embedded (transformers in this process), vllm (vLLM's server from .venv-vllm) or
    remote (any OpenAI-compatible URL; it serves, it does not train)."""
    threads: int | None = None
    """embedded: torch CPU threads (None: torch's default). vllm on a CPU beside a learner:
    the cores vLLM computes on, the learner taking the others (None: half, rounded up);
    with `trainer.overlap=false` both take every core."""
    max_batch: int = 32
    """embedded: most sequences decoded together."""
    prefix_cache_tokens: int = PREFIX_CACHE_TOKENS
    """embedded: most tokens whose KV is kept for prompts that start with them (a session's
    next turn, a shared system prompt), least recently used dropped first; 0 turns it off.
    A token's KV is 45 KiB on SmolLM2-135M in fp32 (30 layers x K,V x 3 heads x 64 x 4 B)."""
    merge_lora: bool = True
    """embedded: a batch whose rows all run on one adapter (an evaluation, a rollout phase
    on one policy version) runs on that adapter's merged weights, without peft's LoRA
    layers; the merged set costs as much memory as the adapted layers' weights, and
    log-probs move by about 1e-5. false: always peft's LoRA path."""
    share_prefixes: bool = False
    """embedded, on a CPU: rows decoded together read the prompt prefix they have in common
    (an agent's system prompt and tool schemas) from one copy of its KV, not each from its
    own (cascade attention). Off by default: 1.10x the decode benchmark's rate and faster
    decode steps, but a main-job evaluation as a whole not yet faster (docs/results.md)."""
    context_length: int | None = None
    """Longest prompt + completion in tokens; None: the model's own (embedded), 4096 (vllm)."""
    max_loras: int = 2
    """vllm: adapters served at once; 2 lets requests in flight finish on the previous
    version while the new one serves new requests."""
    max_lora_rank: int = 16
    """vllm: the largest LoRA rank it accepts (one of vLLM's sizes: 8, 16, 32, 64...)."""
    lora_target_modules: list[str] = field(default_factory=lambda: list(PROJECTIONS))
    """vllm: modules adapters may target (the learner's `trainer.target_modules` must be
    among them); the LM head is left out on purpose (agents/engines/vllm.py says why)."""
    dtype: str = "auto"
    """vllm: weights' dtype; auto is float32 on a CPU (the learner's log-probs match it) and
    bfloat16 on a GPU that has it."""
    kv_cache_gib: int = 1
    """vllm on a CPU: KV-cache size in GiB."""
    gpu_memory_utilization: float | None = None
    """vllm on a GPU: the share of the GPU's memory vLLM takes; the learner gets the rest
    (None: 0.5 when the learner shares the GPU, vLLM's own default otherwise)."""
    startup_timeout: float = 300.0
    """vllm: seconds to wait for the server to answer before failing with its log."""
    python: str | None = None
    """vllm: the Python of vLLM's environment (None: $CLAWGYM_VLLM_PYTHON or .venv-vllm)."""
    base_url: str | None = None
    """remote: the upstream's OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1."""
    api_key: str | None = None
    """remote: the upstream's API key."""
    token_ids: bool = False
    """remote: ask the upstream for vLLM's token ids (token-exact turns)."""


@dataclass
class SamplingConfig:
    """Sampling of every policy turn."""

    temperature: float = 0.6
    """0 is greedy; OpenClaw-RL samples at 0.6."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_tokens: int = 96
    """Tokens per assistant turn, where the env does not size its own (`env.<name>.max_tokens`:
    the agentic groups do)."""


@dataclass
class EnvConfig:
    """One environment of a run. A run plays one or several (a mixture): the `env` group's
    options each land under their own name (`env=[chat,terminal]` gives `env.chat` and
    `env.terminal`), and one env is changed by name: `env.terminal.group_size=2`."""

    id: str = "clawgym/Arith-v0"
    """A registered gymnasium id (`clawgym/<Name>-v0`), or your own env as
    `module:<Namespace>/<Name>-v0`, where importing `module` registers it (gymnasium's
    syntax): an `AgentEnv` subclass trains without changing clawgym."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Registration kwargs of the variant, e.g. {split: test, max_turns: 4}."""
    group_size: int = 1
    """Rollouts per task sharing a group id (the GRPO baseline is taken over a group)."""
    users: str = "simulated"
    """simulated: the env's own users or tasks drive episodes; live: real clients talk to
    the proxy and this env rolls nothing out (Chat-v0's `env.chat.users=live`)."""
    weight: float = 1.0
    """This env's share of the groups a mixture plays, relative to the others' weights."""
    max_tokens: int | None = None
    """Tokens per policy turn here (a shell command or a patch needs more than a chat
    reply); None: the run's `sampling.max_tokens`."""
    judge: str | None = None
    """The judge of this env's turns (a `judge.kind`, e.g. env: the verifiable outcome);
    None: the run's judge."""
    judge_weight: float = 1.0
    """Weight of the judge's per-step score in each turn's reward."""
    outcome_weight: float = 1.0
    """Weight of the episode's outcome in each of its turns' rewards; 0 where the outcome
    is not a training signal (Chat-v0's reward is 0; its preference score is for
    evaluation). A judge that is the outcome (judge: env) counts it once, not twice."""
    eval_kwargs: dict[str, Any] = field(default_factory=lambda: {"split": "test"})
    """What changes in `kwargs` for held-out evaluation during training (`eval`)."""
    eval_episodes: int | None = None
    """Held-out tasks of this env per evaluation; None: the run's `eval.episodes`, 0: this
    env is not evaluated (where an episode takes longer than the training it measures)."""


@dataclass
class ServeSection:
    """The OpenAI-compatible proxy in front of the engine (agents/serving/proxy.py). A training run
    always serves it: its own rollouts reach the policy through it, as live clients do."""

    enabled: bool = False
    """Training: also serve clients on `host:port` during a simulated run (their main turns
    train too); otherwise the rollouts' proxy takes any free loopback port."""
    host: str = "127.0.0.1"
    """Bind address; beyond loopback needs `serve.api_key`."""
    port: int = 30000
    """Listening port (0: any free port, logged at start)."""
    api_key: str | None = None
    """The proxy's own key (or $CLAWGYM_API_KEY): its clients keep their session ids as sent
    (a training run's rollouts send it). Beyond loopback a key is required: this or a user's."""
    api_keys: list[str] = field(default_factory=list)
    """Users' keys, `KEY` or `USER KEY` each (`agents.api_keys`): each user's sessions are
    their own, whichever of their keys they send."""
    api_keys_file: str | None = None
    """A file of such entries, one a line (blank lines and lines starting with # skipped)."""
    admin_key: str | None = None
    """Bearer key of the /admin routes (or $CLAWGYM_ADMIN_KEY); none: one is generated at
    start and logged."""
    turn_type: str = "main"
    """Turn type of requests without `X-Turn-Type`: main turns train, side turns do not."""
    max_tokens: int = 512
    """Completion budget of requests that set none."""
    session_idle_s: float = 600.0
    """A session idle this long has its replies that nothing followed masked (judged
    empty), so the judge moves on without them."""
    idle_timeout_s: float = 30.0
    """A connection without a request under way is closed after this long."""
    request_timeout_s: float = 60.0
    """A request must arrive whole (head and body) within this long of its first byte."""
    log_level: str = "info"
    """`python -m agents.serve`: the server's log level."""
    top_logprobs: int = 0
    """Top-k log-probs each turn keeps at each sampled position, whatever its client asks
    for (0-20); a training run sets it to its top-k method's `method.k`."""


def serve_key(serve: ServeSection) -> str | None:
    """The proxy's own key (its own clients send it): `serve.api_key`, else $CLAWGYM_API_KEY."""
    return serve.api_key or os.environ.get("CLAWGYM_API_KEY") or None


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (localhost or a loopback address)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def validate_engine(engine: EngineConfig) -> None:
    """Raises ValueError, saying the fix, for an engine config that cannot serve."""
    if engine.backend not in ENGINE_BACKENDS:
        raise ValueError(
            f"engine.backend={engine.backend!r}: choose engine=embedded, engine=vllm or "
            "engine=remote"
        )
    if engine.backend == "vllm" and engine.max_loras < 2:
        raise ValueError(
            f"engine.max_loras={engine.max_loras}: vLLM needs room for two adapters (the "
            "version being replaced finishes its requests); set engine.max_loras=2"
        )
    if engine.backend == "remote" and not engine.base_url:
        raise ValueError("engine=remote needs engine.base_url=http://HOST:PORT/v1")
    if engine.prefix_cache_tokens < 0:
        raise ValueError(
            f"engine.prefix_cache_tokens must be >= 0 (0 turns prefix reuse off), got "
            f"{engine.prefix_cache_tokens}"
        )
    usage = engine.gpu_memory_utilization
    if usage is not None and not 0 < usage < 1:
        raise ValueError(f"engine.gpu_memory_utilization must be in (0, 1), got {usage}")


def validate_serve(serve: ServeSection) -> None:
    """Raises ValueError, saying the fix, for a proxy config that cannot serve."""
    if serve.turn_type not in ("main", "side"):
        raise ValueError(f"serve.turn_type must be main or side, got {serve.turn_type!r}")
    if not 0 <= serve.port < 65536:
        raise ValueError(f"serve.port must be in 0..65535, got {serve.port}")
    if not 0 <= serve.top_logprobs <= 20:
        raise ValueError(f"serve.top_logprobs must be in 0..20, got {serve.top_logprobs}")
    limits = {
        "session_idle_s": serve.session_idle_s,
        "idle_timeout_s": serve.idle_timeout_s,
        "request_timeout_s": serve.request_timeout_s,
    }
    for name, limit in limits.items():
        if not limit > 0:
            raise ValueError(f"serve.{name} must be positive, got {limit}")
    users = read_keys(serve.api_keys, serve.api_keys_file, "serve.api_keys")
    if not serve.api_key and not users and not is_loopback(serve.host):
        raise ValueError(
            f"serve.host={serve.host} is beyond loopback: set serve.api_key=... (or "
            "CLAWGYM_API_KEY) or serve.api_keys too"
        )


def validate_env(env: EnvConfig, name: str = "env") -> None:
    """Raises ValueError, saying the fix, for an env config the rollouts cannot play;
    `name` is where it sits in the config (`env.terminal`)."""
    if env.group_size < 1:
        raise ValueError(f"{name}.group_size must be >= 1, got {env.group_size}")
    if env.users not in ("simulated", "live"):
        raise ValueError(f"{name}.users must be simulated or live, got {env.users!r}")
    if not (env.id.startswith("clawgym/") or ":" in env.id):
        raise ValueError(
            f"{name}.id must be a clawgym/ id, or module:Namespace/Name-v0 for an env that "
            f"importing `module` registers; got {env.id!r}"
        )
    if not env.weight > 0:
        raise ValueError(f"{name}.weight must be positive, got {env.weight}")
    if env.max_tokens is not None and env.max_tokens < 1:
        raise ValueError(f"{name}.max_tokens must be >= 1 (or null), got {env.max_tokens}")
    if env.eval_episodes is not None and env.eval_episodes < 0:
        raise ValueError(
            f"{name}.eval_episodes must be >= 0 (0: not evaluated), got {env.eval_episodes}"
        )
    if env.judge_weight < 0 or env.outcome_weight < 0:
        raise ValueError(f"{name}.judge_weight and {name}.outcome_weight must be >= 0")


def validate_envs(envs: dict[str, EnvConfig]) -> None:
    """Raises ValueError, saying the fix, for a run's set of envs."""
    if not envs:
        raise ValueError(
            "the run has no environment: choose one (env=chat) or several (env=[chat,arith])"
        )
    for name, env in envs.items():
        if name == "live" or "/" in name:
            raise ValueError(
                f"env.{name}: `live` (live clients' sessions) and names with '/' (held-out "
                "evaluation's `eval/<env>`) are the store's own; rename the env"
            )
        validate_env(env, f"env.{name}")
