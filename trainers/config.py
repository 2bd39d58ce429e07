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
    serve_key,
    validate_engine,
    validate_envs,
    validate_model,
    validate_serve,
)
from trainers.compute_config import BackendConfig, ClusterConfig, validate_cluster
from trainers.distillation import TOPK_SUBSETS
from trainers.judge_config import JudgeConfig, validate_judge


def validate_judging(judge: JudgeConfig, method: MethodConfig, envs: dict[str, EnvConfig]) -> None:
    """Raises ValueError, saying the fix, where a judge cannot give the method or an env
    what it needs."""
    if method.name in HINTED and judge.kind == "env":
        raise ValueError(
            f"method={method.name} needs hints from an LLM judge; use judge=self or remote"
        )
    for name, env in envs.items():
        if (env.judge or judge.kind) == "env" and env.outcome_weight == 0:
            raise ValueError(
                f"env {name!r} has no outcome to learn from (outcome_weight 0), so judge=env "
                f"gives it no reward: use judge=self, feedback or remote (or env.{name}.judge=...)"
            )
        if method.name in HINT_ONLY and env.judge == "env":
            raise ValueError(
                f"env {name!r} is judged by its outcome (env.{name}.judge=env), which writes "
                f"no hints, and method={method.name} learns from hints only: none of its turns "
                f"would train. Give it an LLM judge (env.{name}.judge=self) or use a method "
                "with a reward term (combine, topk_combine)"
            )
        if env.judge == "remote" and judge.kind != "remote":
            raise ValueError(
                f"env.{name}.judge=remote: a remote judge is configured once, as judge=remote"
            )


@dataclass
class MethodConfig:
    """How judged turns become advantages (trainers/advantages.py)."""

    name: str = "binary"
    """binary (scalar reward), opd (hint distillation), combine (both), topk_opd (hint
    distillation over the student's top-k tokens), topk_combine (topk_opd and binary), oel
    (experience distillation: trainers/experience.py), or sft (supervised fine-tuning on
    demonstrations: the `sft` section)."""
    w_opd: float = 1.0
    """combine, topk_*, oel: weight of the distillation term."""
    w_rl: float = 1.0
    """combine, topk_combine: weight of the reward term (topk_opd: 0)."""
    diff_clip: float | None = 1.0
    """opd, combine: the teacher - rollout difference is clamped to [-diff_clip, diff_clip]
    (null: unclipped; docs/training.md has the measurement behind the default)."""
    k: int = 4
    """topk_*: the size of each position's token set S_t (the old student's top-k)."""
    subset: str = "student"
    """topk_*: S_t is the student's top-k (student), the hinted teacher's (teacher), or
    the student's that the teacher's top-k holds too (overlap)."""
    topk_clip: float | None = 1.0
    """topk_*: c, the teacher - old difference of each member clamped to [-c, c]."""
    teacher_k: int = 50
    """oel: the teacher's top-k tokens the reverse KL runs over, beside one tail bin."""
    experience_max_tokens: int = 2048
    """oel: the most tokens of a session's experience notes."""
    experience_template: str = "experience"
    """oel: the prompt that asks for the notes, a file path or a name in trainers/prompts/."""
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


METHODS = ("binary", "opd", "combine", "topk_opd", "topk_combine", "oel", "sft")
"""The values of `method.name`."""
HINTED = ("opd", "combine", "topk_opd", "topk_combine")
"""The methods that learn from the judge's hints."""
HINT_ONLY = ("opd", "topk_opd")
"""The methods that learn from hints alone (no reward term)."""
TOPK = ("topk_opd", "topk_combine")
"""The methods whose distillation term runs over each position's top-k tokens."""
LEARNER_TEACHER = (*TOPK, "oel")
"""The methods whose teacher is read from the local learner's forward pass."""


def validate_method(method: MethodConfig) -> None:
    """Raises ValueError, saying the fix, for a method the run does not know."""
    if method.name not in METHODS:
        raise ValueError(f"method={method.name!r}: choose method={', '.join(METHODS)}")
    if method.baseline not in ("step", "group"):
        raise ValueError(f"method.baseline must be step or group, got {method.baseline!r}")
    if not 1 <= method.k <= 20:
        raise ValueError(f"method.k must be in 1..20 (OpenAI's top_logprobs), got {method.k}")
    if method.subset not in TOPK_SUBSETS:
        raise ValueError(f"method.subset must be one of {TOPK_SUBSETS}, got {method.subset!r}")
    if method.teacher_k < 1 or method.experience_max_tokens < 1:
        raise ValueError("method.teacher_k and method.experience_max_tokens must be >= 1")
    for name in ("diff_clip", "topk_clip"):
        clip = getattr(method, name)
        if clip is not None and clip <= 0:
            raise ValueError(f"method.{name} must be > 0 or null (unclipped), got {clip}")


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
    """Modules that get adapters: every projection by default. On a vision-language model
    they are matched inside its language model only (`trainers.lora.lora_targets`)."""
    train_vision_tower: bool = False
    """A vision-language model: also put LoRA on every linear layer of its vision tower
    (attention, MLP, the merger into the language model), which is frozen otherwise."""
    clip_low: float = 0.2
    """PPO ratio lower clip: 1 - clip_low."""
    clip_high: float = 0.28
    """PPO ratio upper clip: 1 + clip_high."""
    kl_weight: float = 0.0
    """Weight of KL(policy || base); 0 skips the base forward pass."""
    kl_estimate: bool = True
    """Report `kl_to_start`, a k3 estimate of KL(policy || the policy RL started from), from
    a frozen copy of the starting LoRA weights and one no-grad forward pass over
    `kl_estimate_turns` of each step's turns. Over all of them it cost a quarter to a third
    more time per step (SmolLM2-135M, 8 x 256 tokens, one CPU thread: 22.3 s a step without,
    27.8 to 30.2 s with; the tiny model: +30%), a forward pass beside the step's own
    forward, recompute and backward. false: `kl_to_start` is None. The local learner's only;
    Tinker reports None."""
    kl_estimate_turns: int = 4
    """How many of a step's turns `kl_to_start` reads (evenly spread over the step's turns
    in order of length): the no-grad pass scores only those (4 of the main job's 16: a
    quarter of the turns it scored before). 0: every turn."""
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


def validate_trainer(trainer: TrainerConfig) -> None:
    """Raises ValueError, saying the fix, for a learner or loop value that cannot train."""
    checkpointing_mode(trainer.gradient_checkpointing)
    if trainer.batch_turns < 1 or trainer.max_steps < 0:
        raise ValueError("trainer.batch_turns must be >= 1 and trainer.max_steps >= 0")
    if trainer.max_backlog is not None and trainer.max_backlog < trainer.batch_turns:
        raise ValueError(
            f"trainer.max_backlog ({trainer.max_backlog}) must be >= trainer.batch_turns "
            f"({trainer.batch_turns}), or rollouts pause before a batch is complete"
        )
    if not 0 <= trainer.clip_low < 1 or trainer.clip_high < 0:
        raise ValueError("trainer.clip_low must be in [0, 1) and trainer.clip_high >= 0")
    if trainer.kl_estimate_turns < 0:
        raise ValueError("trainer.kl_estimate_turns must be >= 0 (0: every turn)")
    if trainer.threads is not None and trainer.threads < 1:
        raise ValueError(
            f"trainer.threads must be >= 1 (or null: chosen for you), got {trainer.threads}"
        )
    validate_placement("trainer", trainer.device, trainer.dtype)


def validate_training_engine(engine: EngineConfig, trainer: TrainerConfig) -> None:
    """Raises ValueError, saying the fix, for an engine that cannot serve the adapters the
    learner publishes."""
    if engine.backend == "remote":
        raise ValueError(
            "engine=remote cannot train (the trainer publishes adapters to the engine it "
            "serves); use engine=embedded or engine=vllm"
        )
    if engine.backend != "vllm":
        return
    if trainer.lora_rank > engine.max_lora_rank:
        raise ValueError(
            f"trainer.lora_rank={trainer.lora_rank} is above what vLLM accepts "
            f"(engine.max_lora_rank={engine.max_lora_rank}); raise engine.max_lora_rank"
        )
    unserved = set(trainer.target_modules) - set(engine.lora_target_modules)
    if unserved:
        raise ValueError(
            f"trainer.target_modules {sorted(unserved)} are not in engine.lora_target_modules: "
            "vLLM would refuse the adapter; add them there"
        )


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


def validate_sft(sft: SFTConfig) -> None:
    """Raises ValueError, saying the fix, for a demonstration count that cannot train."""
    if sft.episodes < 1 or sft.warm_start_steps < 0:
        raise ValueError("sft.episodes must be >= 1 and sft.warm_start_steps >= 0")


@dataclass
class RolloutConfig:
    """How simulated episodes are played (trainers/rollouts.py)."""

    groups_in_flight: int = 1
    """Task groups played at once, across the run's envs (each plays its `group_size`
    episodes concurrently): a batching engine decodes all their turns together."""
    max_empty_episodes: int = 32
    """Episodes in a row that give nothing to train on (none played a turn, or the policy's
    server failed under them: `interrupted`) before the run stops: one is data (a task past
    the context, a server that failed once), a run of them is an env or server broken for
    good."""
    max_signalless_groups: int = 32
    """Groups of one env in a row with no learning signal (`method.filter_groups`' rule: every
    reward equal, e.g. a policy that never solves) before the run stops; 0: never. Only
    groups of several rollouts count: a single rollout (live, group_size 1) has no variance."""
    replay_informative: int = 0
    """Times a task is played again (on-policy, ahead of fresh tasks) after a group of it
    earned different rewards from the env: its next group most often has a signal too, so
    dynamic sampling drops fewer (`trainers.rollouts.worth_replaying`); 0: never."""


def validate_rollout(rollout: RolloutConfig) -> None:
    """Raises ValueError, saying the fix, for a rollout value that cannot play."""
    if rollout.groups_in_flight < 1 or rollout.max_empty_episodes < 1:
        raise ValueError("rollout.groups_in_flight and rollout.max_empty_episodes must be >= 1")
    if rollout.replay_informative < 0:
        replays = rollout.replay_informative
        raise ValueError(f"rollout.replay_informative must be >= 0, got {replays}")
    if rollout.max_signalless_groups < 0:
        raise ValueError(
            f"rollout.max_signalless_groups must be >= 0 (0 turns the check off), got "
            f"{rollout.max_signalless_groups}"
        )


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


def validate_eval(evaluation: EvalConfig) -> None:
    """Raises ValueError, saying the fix, for an evaluation value that cannot be played."""
    if evaluation.episodes < 0 or evaluation.every < 0:
        raise ValueError("eval.episodes and eval.every must be >= 0")
    unknown = sorted(set(evaluation.pass_k_at) - set(EVALUATIONS))
    if unknown:
        raise ValueError(f"eval.pass_k_at: unknown {unknown}; use any of {list(EVALUATIONS)}")
    if (evaluation.pass_k is not None and evaluation.pass_k < 0) or evaluation.parallel < 1:
        raise ValueError("eval.pass_k must be >= 0 (or null: the group size), eval.parallel >= 1")


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


CHECKPOINTING = {"auto": "auto", "true": "on", "on": "on", "false": "off", "off": "off"}


def checkpointing_mode(value: str | bool) -> str:
    """`trainer.gradient_checkpointing` as auto, on or off (true and false too, as Hydra and
    YAML give them: a bool, or its string)."""
    mode = CHECKPOINTING.get(str(value).lower())
    if mode is None:
        raise ValueError(f"trainer.gradient_checkpointing={value!r}: use auto, true or false")
    return mode


def validate(config: RunConfig) -> None:
    """Raises ValueError, saying the fix, for any value the run cannot use: each section's
    own validator, then the checks that span sections."""
    validate_envs(config.env)
    validate_model(config.model)
    validate_engine(config.engine)
    validate_serve(config.serve)
    if (config.serve.api_keys or config.serve.api_keys_file) and not serve_key(config.serve):
        raise ValueError(
            "serve.api_keys: a training run's own rollouts reach the proxy with serve.api_key "
            "(its own clients' key); set it (or CLAWGYM_API_KEY) too"
        )
    validate_training_engine(config.engine, config.trainer)
    validate_method(config.method)
    validate_cluster(config.cluster)
    validate_backend(config)
    if config.cluster.replicas and config.engine.backend != "vllm":
        raise ValueError("cluster.replicas are vLLM servers: add engine=vllm")
    validate_sft(config.sft)
    validate_judge(config.judge)
    validate_judging(config.judge, config.method, config.env)
    validate_rollout(config.rollout)
    validate_eval(config.eval)
    validate_trainer(config.trainer)


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
    if config.method.name in LEARNER_TEACHER:
        raise ValueError(
            f"method={config.method.name} takes the teacher's log-probs from the local "
            "learner's forward pass: use backend=local"
        )
    if config.trainer.kl_weight:
        raise ValueError(
            "backend=tinker's loss has no KL term to the base model: set trainer.kl_weight=0"
        )
    if config.cluster.replicas:
        raise ValueError("backend=tinker samples on the Tinker service: drop cluster.replicas")
    if backend.context_length is not None and backend.context_length < 2:
        raise ValueError(f"backend.context_length must be at least 2, got {backend.context_length}")
