"""The trainer side's composition root: builds a run's parts from their sub-configs (the
learner and the engine serving the policy, the judges, the proxy and its seats, where
episodes are played, the held-out evaluator and the loops) and hands them to
`trainers.pipeline.Pipeline`, which only runs them. Engines, proxies and envs come from
`agents.compose`; each part here receives its own sub-config or parts already built.

    learner, engine = build_learner_and_engine(config, run_dir)
    judges = build_judges(config.judge, config.env, engine)
    with serving(config, engine, store) as served:
        pipeline = build_pipeline(config, run_dir, store, learner, judges, served, metrics)
        pipeline.run(overlap=config.trainer.overlap)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from agents.compose import (
    build_engine,
    build_tinker_engine,
    env_factory,
    place_beside_learner,
    serve_policy,
)
from agents.config import EnvConfig, ServeSection, serve_key
from agents.engines.base import Engine
from agents.seats import ProxySeat
from agents.serving.proxy import LIVE_ENV_ID, Proxy
from agents.store import Store
from agents.trajectory import Judgement, Turn, TurnType
from trainers.compute_config import ClusterConfig
from trainers.config import HINTED, TOPK, JudgeConfig, MethodConfig, RunConfig
from trainers.evaluation import Evaluator
from trainers.experience import ExperienceWriter
from trainers.hint_choice import HintChooser, longest_hint
from trainers.judge import Judge, build_judge
from trainers.judging import JudgeLoop
from trainers.learner import Learner
from trainers.learning import PolicyLearner
from trainers.metrics import MetricsWriter
from trainers.pipeline import Loops, Pipeline, Schedule
from trainers.progress import Progress
from trainers.rollouts import EnvSlot, EpisodePlayer, LocalPlayer, MakeEnv, RolloutLoop
from trainers.samples import RewardWeights, reward_weights
from trainers.sft import SFTLoop, prepare_demonstrations
from trainers.topk import TopKSettings
from trainers.training import TrainLoop

logger = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")

RUN_ENDPOINT = "run"
"""`user_base_url: run` in an env's kwargs: its user model is the run's own policy server."""


def topk_settings(method: MethodConfig) -> TopKSettings | None:
    """The learner's top-k term for a top-k method; None for the others."""
    if method.name == "oel":
        return TopKSettings(method.teacher_k, "teacher", None, method.w_opd, loss="oel")
    if method.name not in TOPK:
        return None
    return TopKSettings(method.k, method.subset, method.topk_clip, method.w_opd)


def build_learner_and_engine(config: RunConfig, run_dir: Path) -> tuple[PolicyLearner, Engine]:
    """The learner and the engine serving the policy: the peft learner here and `engine=`,
    or with `backend=tinker` both on a Tinker service (`trainers.tinker_learner`)."""
    if config.backend.kind == "tinker":
        from trainers.tinker_learner import TinkerLearner, tinker_service

        service = tinker_service(config.backend)
        base_model = config.backend.base_model or config.model.name
        learner = TinkerLearner(service, base_model, config.trainer, run_dir, config.seed)
        context = config.backend.context_length or config.engine.context_length
        logger.info(
            "training %s on a Tinker service (rank %d)", base_model, config.trainer.lora_rank
        )
        return learner, build_tinker_engine(service, base_model, config.model, context)
    local = Learner(config.model.name, config.trainer, run_dir, topk_settings(config.method))
    return local, _policy_engine(config, local)


def _policy_engine(config: RunConfig, learner: Learner) -> Engine:
    """The engine that serves the policy: vLLM replicas on Ray (`cluster.replicas`), or the
    one `engine=` builds beside the learner (`place_beside_learner`: on a CPU, vLLM and the
    learner split the cores; on the learner's GPU, vLLM takes a share of its memory)."""
    threads = config.trainer.threads
    if config.cluster.replicas:
        from trainers.cluster import ray_replicas

        if threads:
            torch.set_num_threads(threads)
        return ray_replicas(config.cluster, config.engine, config.model)
    on_cpu = learner.device.type == "cpu"
    learner_cpus, engine_cpus = place_beside_learner(config.engine, on_cpu, config.trainer.overlap)
    if learner_cpus is not None:
        torch.set_num_threads(threads or len(learner_cpus))
        logger.info("cores: learner %s, vLLM %s", learner_cpus, engine_cpus)
    elif threads:
        torch.set_num_threads(threads)
    return build_engine(
        config.engine,
        config.model,
        shares_gpu_with_learner=learner.device.type == "cuda",
        cpus=engine_cpus,
    )


@dataclass(frozen=True)
class Judges:
    """The run's judge (`judge`), and those of envs that name their own (`env.<name>.judge`)."""

    default: Judge
    by_env: Mapping[str, Judge]


def build_judges(judge: JudgeConfig, envs: Mapping[str, EnvConfig], engine: Engine) -> Judges:
    """The run's judges; `engine` serves the policy (and its base model)."""
    return Judges(
        build_judge(judge, engine),
        {
            name: build_judge(dataclasses.replace(judge, kind=env.judge), engine)
            for name, env in envs.items()
            if env.judge is not None and env.judge != judge.kind
        },
    )


@dataclass(frozen=True)
class Served:
    """The policy served for a run, and how the run's own episodes reach it."""

    url: str
    proxy: Proxy
    seat: ProxySeat
    """The seat of the training episodes (main turns)."""
    eval_seat: ProxySeat
    """The seat of held-out evaluations (side turns)."""
    player: EpisodePlayer
    envs: Mapping[str, EnvConfig]
    """The envs whose users are simulated (the ones that roll out), `user_base_url: run`
    pointed at the proxy."""


@contextlib.contextmanager
def serving(config: RunConfig, engine: Engine, store: Store) -> Iterator[Served]:
    """Serves `engine` behind the proxy for the run (the one writer of turns: the run's own
    rollouts reach it over HTTP like any client), with the seats and the player of the
    run's episodes; all of it closed when the run ends."""
    live = any(env.users == "live" for env in config.env.values())
    key = serve_key(config.serve)
    section = served_section(config.serve, config.cluster, live)
    if config.method.name in TOPK:  # every turn keeps the old student's top-k
        section = dataclasses.replace(section, top_logprobs=config.method.k)
    with (
        serve_policy(engine, store, section, config.model) as (url, proxy),
        contextlib.closing(ProxySeat(url, key, admin_key=proxy.admin_key)) as seat,
        contextlib.closing(
            ProxySeat(url, key, turn_type=TurnType.SIDE, admin_key=proxy.admin_key)
        ) as eval_seat,
    ):
        envs = {
            name: with_run_endpoint(env, url, key)
            for name, env in config.env.items()
            if env.users == "simulated"
        }
        with rollout_player(config.cluster, envs, url, key, proxy.admin_key, seat) as player:
            yield Served(url, proxy, seat, eval_seat, player, envs)


def served_section(serve: ServeSection, cluster: ClusterConfig, live: bool) -> ServeSection:
    """Where the proxy listens: the configured address when clients are to reach it (live
    users, `serve.enabled`, rollout workers of other machines: `cluster=ray` with a
    `serve.host` beyond loopback), else any free loopback port for the run's own rollouts."""
    remote_workers = cluster.kind == "ray" and serve.host not in LOOPBACK
    if live or serve.enabled or remote_workers:
        return serve
    return dataclasses.replace(serve, host="127.0.0.1", port=0)


def with_run_endpoint(env: EnvConfig, url: str, api_key: str | None) -> EnvConfig:
    """The env with `user_base_url: run` pointed at the run's proxy: a model-driven user
    (tau2's) played by the policy's base model (adapter off: `base`, never trained; its
    requests are side turns), as tau2 intends its user to be a model."""
    if env.kwargs.get("user_base_url") != RUN_ENDPOINT:
        return env
    kwargs = env.kwargs | {"user_base_url": url, "user_api_key": api_key or "none"}
    kwargs.setdefault("user_model", "base")  # the proxy's name for the adapter off
    return dataclasses.replace(env, kwargs=kwargs)


@contextlib.contextmanager
def cluster_session(config: RunConfig) -> Iterator[None]:
    """Connected to Ray for the run where `cluster=ray` has anything to place on it (rollout
    workers, replicas); nothing otherwise (Ray is not imported)."""
    simulated = any(env.users == "simulated" for env in config.env.values())
    if config.cluster.kind != "ray" or not (simulated or config.cluster.replicas):
        yield
        return
    from trainers.cluster import ray_cluster

    with ray_cluster(config.cluster):
        yield


@contextlib.contextmanager
def rollout_player(
    cluster: ClusterConfig,
    envs: Mapping[str, EnvConfig],
    url: str,
    key: str | None,
    admin_key: str,
    seat: ProxySeat,
) -> Iterator[EpisodePlayer]:
    """Where the run's episodes are played: threads of this process, or the rollout workers
    of a Ray cluster (`cluster=ray`, trainers/cluster.py; Ray is imported only then)."""
    if cluster.kind != "ray" or not envs:
        yield LocalPlayer(seat)
        return
    from trainers.cluster import RayPlayer, worker_url  # Ray is connected (cluster_session)

    player = RayPlayer(cluster, envs, worker_url(url, cluster), key, admin_key, seat)
    try:
        yield player
    finally:
        player.close()


def build_pipeline(
    config: RunConfig,
    run_dir: Path,
    store: Store,
    learner: PolicyLearner,
    judges: Judges,
    served: Served,
    metrics: MetricsWriter,
) -> Pipeline:
    """The run's pipeline: its schedule, evaluator and loops, on the parts built above."""
    progress = Progress()
    schedule = build_schedule(config)
    evaluator = Evaluator(
        config.eval,
        served.envs,
        env_factory,
        served.eval_seat,
        config.sampling,
        metrics,
        run_dir,
        store,
    )
    if schedule.warm_start:
        evaluator.switch_step = schedule.warm_start
    loops = build_loops(
        config, schedule, run_dir, store, learner, judges, served, progress, metrics
    )
    publish = served.proxy.publish_adapter
    return Pipeline(schedule, loops, run_dir, store, learner, progress, publish, metrics, evaluator)


def build_schedule(config: RunConfig) -> Schedule:
    """How far the run goes: an adapter to start from (`trainer.init_adapter`, an SFT
    run's) is the warm start, so an RL method takes `sft.warm_start_steps` only without one."""
    sft = config.method.name == "sft"
    warm = not (sft or config.trainer.init_adapter)
    return Schedule(
        max_steps=config.trainer.max_steps,
        warm_start=config.sft.warm_start_steps if warm else 0,
        batch_turns=config.trainer.batch_turns,
        eval_before=config.eval.before,
        init_adapter=config.trainer.init_adapter,
        sft=sft,
    )


def build_loops(
    config: RunConfig,
    schedule: Schedule,
    run_dir: Path,
    store: Store,
    learner: PolicyLearner,
    judges: Judges,
    served: Served,
    progress: Progress,
    metrics: MetricsWriter,
) -> Loops:
    """The judging, training, supervised and rollout loops of the run."""
    hints = config.method.name in HINTED
    judging = JudgeLoop(
        store,
        judges.default,
        judges.by_env,
        hints,
        progress,
        experience_writer(config, store, served.proxy.engine),
    )
    publish = served.proxy.publish_adapter
    make_envs = {name: env_factory(env) for name, env in served.envs.items()}
    supervised, prepare = None, None
    if schedule.sft or schedule.warm_start:
        sft_args = (store, publish, progress, metrics, config.seed)
        supervised = SFTLoop(config.trainer, config.sft, local(learner), *sft_args)
        prepare = demonstrations(config, local(learner), store, make_envs)
    if supervised is not None and schedule.sft:
        # supervised fine-tuning plays no episode: its envs only demonstrate
        return Loops(judging, supervised, supervised, None, {}, prepare)
    training = TrainLoop(
        config.trainer,
        config.method,
        config.env,
        env_weights(config),
        learner,
        store,
        publish,
        progress,
        metrics,
        run_dir,
        max_signalless_groups=config.rollout.max_signalless_groups,
        encode=served.proxy.engine.encode,
        choose_hint=hint_chooser(config, learner, served.proxy.engine),
    )
    slots = {name: EnvSlot(name, config.env[name], make) for name, make in make_envs.items()}
    rollouts = rollout_loop(config, slots, served.player, progress, training) if slots else None
    return Loops(judging, training, supervised, rollouts, slots, prepare)


def experience_writer(config: RunConfig, store: Store, engine: Engine) -> ExperienceWriter | None:
    """What writes each ended session's experience notes (`method=oel`); None otherwise."""
    method = config.method
    if method.name != "oel":
        return None
    temperature = config.sampling.temperature
    return ExperienceWriter(
        engine, store, method.experience_template, method.experience_max_tokens, temperature
    )


def hint_chooser(
    config: RunConfig, learner: PolicyLearner, engine: Engine
) -> Callable[[Turn], Judgement] | None:
    """What chooses among a turn's hint candidates by overlap: the local learner's model
    (`trainers.hint_choice`); a learner without one (Tinker) takes the longest."""
    if not isinstance(learner, Learner):
        if config.method.name in HINTED and config.judge.hint_selection == "overlap":
            logger.warning(
                "backend=%s has no full logits to score overlap: longest hints win",
                config.backend.kind,
            )
        return functools.partial(longest_hint, engine)
    chunk = config.trainer.logprob_chunk
    k = config.judge.overlap_k
    return HintChooser(learner.model, engine.encode, k, chunk, learner.pixels).choose


def rollout_loop(
    config: RunConfig,
    slots: Mapping[str, EnvSlot],
    player: EpisodePlayer,
    progress: Progress,
    training: TrainLoop,
) -> RolloutLoop:
    """The loop that plays the envs' task groups, pausing while more than
    `trainer.backlog` turns wait for `training`."""
    return RolloutLoop(
        config.rollout,
        slots,
        player,
        config.sampling,
        config.seed,
        progress,
        has_room=training.has_room,
    )


def local(learner: PolicyLearner) -> Learner:
    """The learner as the local peft one, which supervised steps need.

    Raises:
        ValueError: another learner (`backend=tinker`; `validate` refuses that first).
    """
    if not isinstance(learner, Learner):
        raise ValueError("supervised steps are the local learner's: use backend=local")
    return learner


def demonstrations(
    config: RunConfig, learner: Learner, store: Store, make_envs: Mapping[str, MakeEnv]
) -> Callable[[], None]:
    """What puts the run's demonstrations in its store (`prepare_demonstrations`), scored
    by `learner` as it is once the run has resumed."""
    # what the engine serves: its configured context, else the model's own
    context = config.engine.context_length or getattr(
        learner.model.config, "max_position_embeddings", None
    )
    return functools.partial(
        prepare_demonstrations,
        config.sft,
        make_envs,
        store,
        learner,
        config.model.name,
        config.seed,
        context,
    )


def env_weights(config: RunConfig) -> dict[str, RewardWeights]:
    """Each env's reward weights by name, under the judge it is scored by; live
    conversations (the proxy's "live" sessions) have no outcome."""
    weights = {LIVE_ENV_ID: reward_weights(None, config.method, config.judge.kind)}
    for name, env in config.env.items():
        weights[name] = reward_weights(env, config.method, env.judge or config.judge.kind)
    return weights
