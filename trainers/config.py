"""Typed configs of `python -m trainers.run`, composed by Hydra from `trainers/conf/` on top
of the shared groups of `agents/conf/` (model, engine, env; their schemas are in
`agents.config`).

Each component receives its own sub-config. Every field has a one-line doc, and
`validate` says how to fix a bad value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from agents.config import (
    PROJECTIONS,
    EngineConfig,
    EnvConfig,
    ModelConfig,
    SamplingConfig,
    ServeSection,
    validate_engine,
    validate_envs,
    validate_serve,
)


@dataclass
class JudgeConfig:
    """Who scores turns and writes hints (trainers/judge.py)."""

    kind: str = "self"
    """self (the policy's base model), remote (an OpenAI-compatible URL), env (the
    environment's outcome), feedback (a phrase lexicon reading the user's reply; for
    machines without a capable judge model), or a custom judge as `module:Class`."""
    votes: int = 3
    """m: samples per turn for the score, and again for the hint."""
    decoding: str = "guided"
    """guided: votes are sampled from the judge model's probabilities of the valid answers
    (every vote valid, three short scoring passes), hints written as plain text after a
    guided yes; free: the judge writes its reasoning and answer, parsed as OpenClaw-RL does."""
    temperature: float = 0.6
    """Sampling temperature of the votes."""
    max_tokens: int = 128
    """Tokens per judge answer."""
    score_template: str = "judge_score"
    """Score prompt: a file path, or a name in trainers/prompts/."""
    hint_template: str = "judge_hint"
    """Hint prompt: a file path, or a name in trainers/prompts/."""
    hint_text_template: str = "judge_hint_text"
    """guided decoding: the prompt that asks for the hint alone, after a guided yes."""
    hint_min_chars: int = 10
    """Hints of this many characters or fewer are rejected."""
    base_url: str | None = None
    """remote judge: the OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1."""
    api_key: str | None = None
    """remote judge: its API key."""
    model: str | None = None
    """remote judge: the model name to ask for."""


@dataclass
class MethodConfig:
    """How judged turns become advantages (trainers/advantages.py)."""

    name: str = "binary"
    """binary (scalar reward), opd (hint distillation), combine (both), or sft (supervised
    fine-tuning on demonstrations: the `sft` section)."""
    w_opd: float = 1.0
    """combine: weight of the teacher - rollout term."""
    w_rl: float = 1.0
    """combine: weight of the reward term."""
    use_judge: bool = True
    """binary / combine: take the judge's majority score as reward."""
    use_env_reward: bool = True
    """binary / combine: add the environment's outcome reward."""
    scale_by_std: bool = False
    """GRPO: divide by the group's std as well as subtracting its mean."""
    baseline: str = "step"
    """The baseline a turn's reward is centred on: step (the mean over the group's turns at
    the same step index, OpenClaw-RL's step-wise advantage) or group (over all the
    group's turns)."""
    filter_groups: bool = True
    """Dynamic sampling (DAPO): a group of several rollouts that carries no learning signal
    (no turn's reward differs from its baseline's mean; opd and combine: nor has a hint) is
    dropped whole, counted in the step's `filtered_groups`, and more groups are played until
    a step holds `trainer.batch_turns` turns; false: binary takes whole groups in order, a
    uniform group's turns with advantage 0 (DAPO's baseline: a smaller effective batch)."""


@dataclass
class TrainerConfig:
    """The LoRA learner and the training loop (trainers/learner.py, trainers/pipeline.py)."""

    max_steps: int = 8
    """Optimiser steps before the run ends."""
    batch_turns: int = 16
    """Turns per optimiser step (OpenClaw-RL trains on 16)."""
    micro_batch_tokens: int = 4096
    """Token budget of one forward/backward pass; gradients accumulate across them."""
    lr: float = 1e-4
    """AdamW learning rate (OpenClaw-RL's LoRA rate)."""
    lora_rank: int = 16
    """LoRA rank r."""
    lora_alpha: int = 32
    """LoRA alpha."""
    target_modules: list[str] = field(default_factory=lambda: list(PROJECTIONS))
    """Modules that get adapters: every projection by default."""
    clip_low: float = 0.2
    """PPO ratio lower clip: 1 - clip_low."""
    clip_high: float = 0.28
    """PPO ratio upper clip: 1 + clip_high."""
    kl_weight: float = 0.0
    """Weight of KL(policy || base); 0 skips the base forward pass."""
    kl_estimate: bool = True
    """Report `kl_to_start`, a k3 estimate of KL(policy || the policy RL started from), from
    a frozen copy of the starting LoRA weights and one no-grad forward pass over each step's
    turns: a quarter to a third more time per step (SmolLM2-135M, 8 x 256 tokens, one CPU
    thread: 22.3 s a step without, 27.8 to 30.2 s with; the tiny model: +30%), a forward
    pass beside the step's own forward, recompute and backward. false: `kl_to_start` is
    None. The local learner's only; Tinker reports None."""
    importance_cap: float = 2.0
    """Truncation of the importance weight of turns from older adapters."""
    max_staleness: int = 2
    """Turns sampled more than this many adapter versions ago are dropped."""
    grad_clip: float = 1.0
    """Max global gradient norm."""
    gradient_checkpointing: str = "auto"
    """Recompute activations in backward (less memory, a quarter to a third more time):
    auto, for each pass whose activations would not fit `memory_budget_gib` (estimated,
    `trainers.lora.activation_bytes`); true or false, always or never."""
    memory_budget_gib: float | None = None
    """What a pass's activations may take before `gradient_checkpointing=auto` turns
    checkpointing on for it; None: half the memory available when the learner starts (the
    GPU's free memory on a GPU, else the system's)."""
    share_prefix: bool = True
    """Run the tokens every turn of a micro-batch starts with (the system prompt and tool
    schemas: most of an agent turn's tokens) once, not once per turn: the same log-probs
    and gradients (within float rounding). Not with gradient checkpointing."""
    pack_turns: bool = True
    """Run a multi-turn episode's turns as one row where each turn's tokens begin the
    next's (token-exact serving makes them so): its last turn, every turn's completion
    scored where it sits; the same log-probs and gradients (within float rounding)."""
    logprob_chunk: int = 128
    """Positions per chunk when computing target log-probs (never the full logits)."""
    mmap_threshold_kb: int = 0
    """glibc malloc: allocations from this size on are mapped and returned to the system
    when freed; 0 keeps glibc's adaptive threshold. Adaptive is faster, fixed is smaller:
    a LoRA step on SmolLM2 at 8 x 512 tokens took 31.5 s at 5.5 GiB peak RSS adaptive,
    44.3 s at 1.45 GiB with 1024 (every large tensor a fresh mapping, its pages faulted in
    again each step; 4096: 45.8 s, 16384: 33.9 s at 4.8 GiB; measured here with
    benchmarks/perf/learner.py). Set 1024 where memory is short. Lower is not better: at
    128 KiB the embedded engine's per-token KV-cache copies are mapped too, and decoding 4
    sequences in the same process ran 25% slower."""
    max_backlog: int | None = None
    """Turns waiting for training (collected or judged, the batch being trained included)
    before rollouts pause: the bounded queue. None: 2 x batch_turns, which lets the rollout
    play one batch ahead of the learner; more only makes turns staler."""
    overlap: bool = True
    """Run rollout, judging and training concurrently; false alternates them strictly
    (each rollout phase plays `rollout.groups_in_flight` groups at once, and a vLLM server
    on a CPU computes on every core, as the learner does, since they never run together)."""
    init_adapter: str | None = None
    """Start from this LoRA adapter (a directory with adapter_config.json, or a run
    directory: its newest adapters/v<N>, e.g. an SFT run's) instead of the base model. It
    is served as version 1, so the first rollouts are sampled with it. A run that resumes
    from its own checkpoint ignores it."""
    wandb_project: str | None = None
    """Also log metrics to this W&B project (needs `pip install wandb`)."""
    device: str = "auto"
    """Where the learner trains: auto (cuda when present, else cpu), cpu or cuda."""
    threads: int | None = None
    """The learner's torch CPU threads. None: torch's default (every core), or where a vLLM
    server computes on the same CPU, the cores it leaves (`engine.threads`)."""
    dtype: str = "auto"
    """The learner's weights: auto (bfloat16 on a GPU that has it, else float32), float32
    or bfloat16. The LoRA weights and the optimiser state stay float32."""

    @property
    def backlog(self) -> int:
        """`max_backlog`, or its default of two batches."""
        return self.max_backlog if self.max_backlog is not None else 2 * self.batch_turns


@dataclass
class SFTConfig:
    """Supervised fine-tuning on demonstrations (`method=sft`, trainers/sft.py)."""

    demonstrations: str = "reference"
    """reference: each env's scripted reference agent plays `episodes` of its tasks (its
    `kwargs` split), stored token-exactly in the run's store; or the path of a store's
    parquet export (`python -m agents.export RUN_DIR`)."""
    episodes: int = 64
    """reference: demonstrations recorded per env."""
    min_outcome_reward: float | None = 0.0
    """Only demonstrations whose episode earned more than this train (a reference agent
    that failed a task shows nothing worth copying); None: every one."""
    lr: float | None = None
    """The supervised steps' learning rate; None: `trainer.lr`. Imitation takes a larger
    one than RL: a warm start then hands RL `trainer.lr`."""
    warm_start_steps: int = 0
    """With an RL method: this many supervised steps on the demonstrations first, in the
    same run (evaluated at their end with `eval`), then `trainer.max_steps` RL steps from
    that adapter. 0: none. A run given `trainer.init_adapter` starts from that adapter
    instead and takes none."""


@dataclass
class RolloutConfig:
    """How simulated episodes are played (trainers/rollouts.py)."""

    groups_in_flight: int = 1
    """Task groups played at once, across the run's envs (each plays its `group_size`
    episodes concurrently): a batching engine decodes all their turns together."""
    max_empty_episodes: int = 32
    """Episodes in a row that end before their first turn before the run stops: one is
    data (a task past the context), a run of them is an env or server broken for good."""
    max_signalless_groups: int = 32
    """Groups of one env in a row with no learning signal (`method.filter_groups`' rule: every
    reward equal, e.g. a policy that never solves) before the run stops; 0: never. Only
    groups of several rollouts count: a single rollout (live, group_size 1) has no variance."""


@dataclass
class ClusterConfig:
    """Where rollouts run (`cluster=`, trainers/cluster.py): in the trainer's process, or
    on a Ray cluster. The learner and the store stay in the trainer's process either way,
    and the proxy stays the one writer of turns."""

    kind: str = "local"
    """local: episodes play on threads of the trainer's process (Ray is not imported);
    ray: on rollout workers, Ray actors each holding a pool of env instances."""
    address: str | None = None
    """ray: the cluster to join (`HOST:PORT` of its head); None: $RAY_ADDRESS, else a Ray
    started on this machine for the run (and stopped with it)."""
    workers: int = 2
    """ray: rollout workers."""
    worker_cpus: float = 1.0
    """ray: CPUs each worker reserves (its sandboxes and browsers run on its node)."""
    spread: bool = True
    """ray: place workers on as many nodes as there are (Ray's SPREAD), rather than packed."""
    proxy_host: str | None = None
    """ray: the address workers reach the proxy at, where it is not the one the proxy binds
    (a proxy on 0.0.0.0: this node's address on the cluster's network)."""
    replicas: int = 0
    """ray with engine=vllm: vLLM replicas as Ray actors behind the proxy, routed by session
    (`agents.engines.replicas`); 0: the engine runs beside the trainer as `engine=` says."""
    replica_cpus: float = 1.0
    """ray: CPUs each replica reserves (on a CPU node, the cores its threads are bound to)."""
    replica_gpus: float = 0.0
    """ray: GPUs each replica reserves (1: a GPU of its own; 0.5: half of one, with
    `engine.gpu_memory_utilization` at most 0.5)."""
    place_timeout_s: float = 600.0
    """ray: seconds the workers and replicas may wait for a place on the cluster (a replica
    then has `engine.startup_timeout` more to answer); past it the run stops, naming what it
    asked for and what the cluster has, rather than wait for resources that never come."""


@dataclass
class BackendConfig:
    """Where the LoRA steps, sampling and teacher log-probs run (`backend=`): this process's
    learner and `engine=`, or a Tinker service (`trainers.tinker_learner`,
    `agents.engines.tinker`); the proxy, store, judges and methods are the same either way."""

    kind: str = "local"
    """local: the peft learner here and the configured engine; tinker: a Tinker service."""
    base_url: str | None = None
    """tinker: the service's address; None: $TINKER_BASE_URL (unset: Tinker's own cloud)."""
    api_key: str | None = None
    """tinker: its API key; None: $TINKER_API_KEY (kept out of the config written to the run)."""
    base_model: str | None = None
    """tinker: the service's name of the base model; None: `model.name`."""
    context_length: int | None = None
    """tinker: the longest prompt plus completion sampled; None: `engine.context_length`,
    else the model's `max_position_embeddings`."""


EVALUATIONS = ("before", "switch", "every", "after")
"""The evaluations of a run, by when they come (`EvalConfig.pass_k_at`)."""


@dataclass
class EvalConfig:
    """Held-out evaluation during training (trainers/evaluation.py)."""

    episodes: int = 0
    """Held-out tasks per env, played greedily before training, every `every` steps and
    after the last; 0 turns evaluation off."""
    every: int = 0
    """Steps between evaluations; 0: only before and after."""
    before: bool = True
    """Evaluate the starting policy before the first step. False where it was evaluated
    already on the same tasks (an RL run from an SFT run's final adapter, which that run
    scored at its end): the run then reports no "before" of its own."""
    max_tokens: int | None = None
    """Tokens per turn while evaluating; None: each env's own."""
    pass_k: int | None = None
    """Samples per held-out task at the run's sampling temperature, for pass@k beside the
    greedy pass@1 (k of them: k times the episodes); None: each env's `group_size`, the
    rollouts a task gets in training; 0 or 1: greedy pass@1 only."""
    pass_k_at: list[str] = field(default_factory=lambda: list(EVALUATIONS))
    """The evaluations that draw the pass@k samples, of `EVALUATIONS`: before (the first),
    switch (from a warm start's imitation to RL), every (each `every` steps) and after (the
    last); the others play greedy pass@1 alone. Each sample set costs k times a greedy
    evaluation, and the base model's most (its replies run to `max_tokens` every turn)."""
    parallel: int = 16
    """Evaluation episodes played at once (a batching engine decodes their turns together;
    at most `engine.max_batch` rows)."""


@dataclass
class RunConfig:
    """The root config."""

    env: dict[str, EnvConfig] = field(default_factory=dict)
    """The run's environments by name (the `env` group's options: env=[chat,terminal])."""
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    serve: ServeSection = field(default_factory=ServeSection)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    seed: int = 0
    """Seeds task choice, sampling and the LoRA initialisation."""
    run_dir: str = "runs/${now:%Y%m%d-%H%M%S}"
    """Where the store, the export and the resolved config go."""


METHODS = ("binary", "opd", "combine", "sft")
"""The values of `method.name`."""


CHECKPOINTING = {"auto": "auto", "true": "on", "on": "on", "false": "off", "off": "off"}


def checkpointing_mode(value: str | bool) -> str:
    """`trainer.gradient_checkpointing` as auto, on or off (true and false too, as Hydra and
    YAML give them: a bool, or its string)."""
    mode = CHECKPOINTING.get(str(value).lower())
    if mode is None:
        raise ValueError(f"trainer.gradient_checkpointing={value!r}: use auto, true or false")
    return mode


def validate(config: RunConfig) -> None:
    """Raises ValueError, saying the fix, for any value the run cannot use."""
    validate_envs(config.env)
    validate_engine(config.engine)
    validate_serve(config.serve)
    if config.engine.backend == "remote":
        raise ValueError(
            "engine=remote cannot train (the trainer publishes adapters to the engine it "
            "serves); use engine=embedded or engine=vllm"
        )
    if config.engine.backend == "vllm" and config.trainer.lora_rank > config.engine.max_lora_rank:
        raise ValueError(
            f"trainer.lora_rank={config.trainer.lora_rank} is above what vLLM accepts "
            f"(engine.max_lora_rank={config.engine.max_lora_rank}); raise engine.max_lora_rank"
        )
    unserved = set(config.trainer.target_modules) - set(config.engine.lora_target_modules)
    if config.engine.backend == "vllm" and unserved:
        raise ValueError(
            f"trainer.target_modules {sorted(unserved)} are not in engine.lora_target_modules: "
            "vLLM would refuse the adapter; add them there"
        )
    if config.method.name not in METHODS:
        raise ValueError(
            f"method={config.method.name!r}: choose method=binary, opd, combine or sft"
        )
    validate_cluster(config.cluster)
    validate_backend(config)
    if config.cluster.replicas and config.engine.backend != "vllm":
        raise ValueError("cluster.replicas are vLLM servers: add engine=vllm")
    if config.sft.episodes < 1 or config.sft.warm_start_steps < 0:
        raise ValueError("sft.episodes must be >= 1 and sft.warm_start_steps >= 0")
    if config.judge.votes < 1:
        raise ValueError(f"judge.votes must be >= 1, got {config.judge.votes}")
    if config.judge.kind == "remote" and not (config.judge.base_url and config.judge.model):
        raise ValueError(
            "judge=remote needs judge.base_url=http://HOST:PORT/v1 (and judge.model=NAME)"
        )
    if config.method.name in ("opd", "combine") and config.judge.kind == "env":
        raise ValueError(
            f"method={config.method.name} needs hints from an LLM judge; use judge=self or remote"
        )
    if config.method.baseline not in ("step", "group"):
        raise ValueError(f"method.baseline must be step or group, got {config.method.baseline!r}")
    for name, env in config.env.items():
        if (env.judge or config.judge.kind) == "env" and env.outcome_weight == 0:
            raise ValueError(
                f"env {name!r} has no outcome to learn from (outcome_weight 0), so judge=env "
                f"gives it no reward: use judge=self, feedback or remote (or env.{name}.judge=...)"
            )
        if env.judge == "remote" and config.judge.kind != "remote":
            raise ValueError(
                f"env.{name}.judge=remote: a remote judge is configured once, as judge=remote"
            )
    if config.rollout.groups_in_flight < 1 or config.rollout.max_empty_episodes < 1:
        raise ValueError("rollout.groups_in_flight and rollout.max_empty_episodes must be >= 1")
    if config.rollout.max_signalless_groups < 0:
        raise ValueError(
            f"rollout.max_signalless_groups must be >= 0 (0 turns the check off), got "
            f"{config.rollout.max_signalless_groups}"
        )
    if config.eval.episodes < 0 or config.eval.every < 0:
        raise ValueError("eval.episodes and eval.every must be >= 0")
    unknown = sorted(set(config.eval.pass_k_at) - set(EVALUATIONS))
    if unknown:
        raise ValueError(f"eval.pass_k_at: unknown {unknown}; use any of {list(EVALUATIONS)}")
    if (config.eval.pass_k is not None and config.eval.pass_k < 0) or config.eval.parallel < 1:
        raise ValueError("eval.pass_k must be >= 0 (or null: the group size), eval.parallel >= 1")
    checkpointing_mode(config.trainer.gradient_checkpointing)
    if config.trainer.batch_turns < 1 or config.trainer.max_steps < 0:
        raise ValueError("trainer.batch_turns must be >= 1 and trainer.max_steps >= 0")
    if config.trainer.max_backlog is not None and (
        config.trainer.max_backlog < config.trainer.batch_turns
    ):
        raise ValueError(
            f"trainer.max_backlog ({config.trainer.max_backlog}) must be >= trainer.batch_turns "
            f"({config.trainer.batch_turns}), or rollouts pause before a batch is complete"
        )
    if not 0 <= config.trainer.clip_low < 1 or config.trainer.clip_high < 0:
        raise ValueError("trainer.clip_low must be in [0, 1) and trainer.clip_high >= 0")
    if config.trainer.threads is not None and config.trainer.threads < 1:
        raise ValueError(
            f"trainer.threads must be >= 1 (or null: chosen for you), got {config.trainer.threads}"
        )
    validate_placement("trainer", config.trainer.device, config.trainer.dtype)


def validate_placement(section: str, device: str, dtype: str) -> None:
    """Raises ValueError for a learner device or dtype `trainers.lora` does not know;
    `section` names the config section in the message."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"{section}.device must be auto, cpu or cuda, got {device!r}")
    if dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"{section}.dtype must be auto, float32 or bfloat16, got {dtype!r}")


def register_configs() -> None:
    """Makes the typed schema known to Hydra as `run_schema`."""
    ConfigStore.instance().store(name="run_schema", node=RunConfig)


def validate_backend(config: RunConfig) -> None:
    """Raises ValueError, saying the fix, for a backend the run cannot use."""
    backend = config.backend
    if backend.kind not in ("local", "tinker"):
        raise ValueError(f"backend={backend.kind!r}: choose backend=local or backend=tinker")
    if backend.kind == "local":
        return
    if not (backend.api_key or os.environ.get("TINKER_API_KEY")):
        raise ValueError(
            "backend=tinker needs the service's API key: set TINKER_API_KEY=tml-... (any "
            "tml- key for clawgym's own server on loopback) or backend.api_key"
        )
    if config.method.name == "sft" or config.sft.warm_start_steps:
        raise ValueError(
            "backend=tinker takes RL steps only: use method=binary, opd or combine with "
            "sft.warm_start_steps=0"
        )
    if config.trainer.init_adapter:
        raise ValueError("backend=tinker starts from the base model: drop trainer.init_adapter")
    if config.trainer.kl_weight:
        raise ValueError(
            "backend=tinker's loss has no KL term to the base model: set trainer.kl_weight=0"
        )
    if config.cluster.replicas:
        raise ValueError("backend=tinker samples on the Tinker service: drop cluster.replicas")
    if backend.context_length is not None and backend.context_length < 2:
        raise ValueError(f"backend.context_length must be at least 2, got {backend.context_length}")


def validate_cluster(cluster: ClusterConfig) -> None:
    """Raises ValueError, saying the fix, for a cluster the run cannot use."""
    if cluster.kind not in ("local", "ray"):
        raise ValueError(f"cluster={cluster.kind!r}: choose cluster=local or cluster=ray")
    if cluster.workers < 1 or cluster.worker_cpus <= 0:
        raise ValueError(
            f"cluster.workers must be >= 1 and cluster.worker_cpus > 0, got "
            f"{cluster.workers} and {cluster.worker_cpus}"
        )
    if cluster.place_timeout_s <= 0:
        raise ValueError(f"cluster.place_timeout_s must be > 0, got {cluster.place_timeout_s}")
    if cluster.replicas < 0 or cluster.replica_cpus <= 0 or cluster.replica_gpus < 0:
        raise ValueError(
            "cluster.replicas must be >= 0, cluster.replica_cpus > 0 and cluster.replica_gpus >= 0"
        )
    if cluster.replicas and cluster.kind != "ray":
        raise ValueError("cluster.replicas places vLLM replicas on Ray: add cluster=ray")
