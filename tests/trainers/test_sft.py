"""Supervised fine-tuning (`method=sft`) on demonstrations, and RL that starts from its
adapter (`trainer.init_adapter`)."""

import dataclasses
import functools
import json
import logging
from collections import Counter

import gymnasium as gym
import pytest
import torch

import envs  # noqa: F401  (registers the clawgym/ environments)
from agents.config import EnvConfig
from agents.demonstrations import DEMONSTRATION
from agents.rollout import EpisodeSummary
from agents.store import Store
from agents.trajectory import SessionStatus, TurnStatus, TurnType
from tests.trainers.test_run import train
from trainers.config import RunConfig, SFTConfig, TrainerConfig
from trainers.learner import Learner
from trainers.progress import Progress
from trainers.sft import (
    DemonstrationsFailed,
    NoDemonstrations,
    SFTLoop,
    batch_order,
    failures,
    prepare_demonstrations,
)

# Four arith demonstrations make eight turns: one batch of all of them a step, so each
# step's loss is the same turns' loss before that step's update.
SFT = [
    "env=arith",
    "method=sft",
    "sft.episodes=4",
    "trainer.batch_turns=8",
    "sft.lr=2e-3",
]


@pytest.mark.parametrize(("count", "batch"), [(10, 4), (8, 8), (5, 3)])
def test_batches_cover_every_item_once_an_epoch_and_resume_from_the_step_alone(count, batch):
    steps = count * 3 // batch
    seen = [i for step in range(steps) for i in batch_order(count, batch, step, seed=7)]
    assert all(len(batch_order(count, batch, s, seed=7)) == batch for s in range(steps))
    epochs = [seen[e * count : (e + 1) * count] for e in range(len(seen) // count)]
    assert all(sorted(epoch) == list(range(count)) for epoch in epochs)
    assert epochs[0] != epochs[1] or count < 3  # reshuffled every epoch
    assert batch_order(count, batch, 2, seed=7) == batch_order(count, batch, 2, seed=7)


def test_sft_on_reference_demonstrations_lowers_their_loss(tmp_path):
    run_dir = tmp_path / "sft"
    summary = train(run_dir, *SFT, "trainer.max_steps=4")
    assert (summary["method"], summary["steps"], summary["adapter_version"]) == ("sft", 4, 4)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 4 and all(r["demonstrations"] == 8 for r in rows if "loss" in r)
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.9 * losses[0], losses
    with Store(run_dir / "store.sqlite") as store:
        sessions = store.sessions()
        assert len(sessions) == 4 and all(s.outcome_reward == 1.0 for s in sessions)
        assert all(s.metadata[DEMONSTRATION] == "ArithReferenceAgent" for s in sessions)
        # the SFT run plays no episode of its own
        assert {s.env_id for s in sessions} == {"arith"}


def test_a_run_told_its_start_was_evaluated_elsewhere_evaluates_only_after_training(tmp_path):
    run_dir = tmp_path / "no-before"
    summary = train(run_dir, *SFT, "trainer.max_steps=2", "eval.episodes=2", "eval.before=false")
    held_out = summary["held_out"]["arith"]
    assert held_out["before"] is None
    assert (held_out["after"]["step"], held_out["after"]["episodes"]) == (2, 2)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_pass_at_1" in r] == [2]


def test_rl_from_an_sft_adapter_samples_its_first_rollouts_with_that_adapter(tmp_path):
    sft_dir = tmp_path / "sft"
    train(sft_dir, *SFT, "trainer.max_steps=3")
    rl_dir = tmp_path / "rl"
    summary = train(
        rl_dir,
        "env=arith",
        "method=binary",  # judged by the (tiny) self-judge: its votes vary, so a step comes
        "env.arith.group_size=2",
        "env.arith.max_tokens=24",
        f"trainer.init_adapter={sft_dir}",
        "sft.warm_start_steps=2",  # the adapter is the warm start: none is taken
        "trainer.max_steps=1",
    )
    assert (summary["steps"], summary["adapter_version"]) == (1, 2)  # v1 is the SFT adapter
    with Store(rl_dir / "store.sqlite") as store:
        first = [t for _, t in store.turns(turn_type=TurnType.MAIN)][:4]
        assert not any(DEMONSTRATION in s.metadata for s in store.sessions())
    assert Counter(t.policy_version for t in first) == {1: len(first)}
    # their log-probs are the SFT adapter's, not the base model's
    config = TrainerConfig(lora_rank=4)
    with_adapter = Learner("tiny", config, tmp_path / "check")
    base = [with_adapter.logprobs(t.prompt_token_ids, t.completion_token_ids) for t in first]
    with_adapter.start_from(sft_dir / "adapters" / "v3")
    tuned = [with_adapter.logprobs(t.prompt_token_ids, t.completion_token_ids) for t in first]
    stored = [t.completion_logprobs for t in first]

    def gap(reference):
        return max(
            (torch.tensor(s) - torch.tensor(r)).abs().max().item()
            for s, r in zip(stored, reference, strict=True)
        )

    assert gap(tuned) < 1e-3 < gap(base)


def test_sft_learns_from_a_parquet_export_of_another_run(tmp_path):
    first = tmp_path / "first"
    train(first, *SFT, "trainer.max_steps=1")
    from agents import export

    assert export.main([str(first)]) == 0
    second = tmp_path / "second"
    summary = train(
        second,
        *SFT,
        f"sft.demonstrations={first / 'turns.parquet'}",
        "trainer.max_steps=1",
    )
    assert summary["steps"] == 1
    with Store(second / "store.sqlite") as store:
        sessions = store.sessions()
    assert len(sessions) == 4
    assert all(s.metadata[DEMONSTRATION].startswith("parquet:") for s in sessions)


WARM_START = (
    "env=arith",
    "method=binary",
    "env.arith.group_size=2",
    "env.arith.max_tokens=24",
    "sft.episodes=4",
    "sft.warm_start_steps=2",
    "trainer.batch_turns=4",
    "eval.episodes=2",
)
"""A binary run on arith after a warm start of 2 supervised steps on 4 demonstrations."""


def test_a_warm_start_takes_supervised_steps_then_rl_samples_from_their_adapter(tmp_path):
    run_dir = tmp_path / "warm"
    summary = train(run_dir, *WARM_START, "sft.lr=2e-3", "trainer.max_steps=1")
    assert (summary["steps"], summary["adapter_version"]) == (3, 3)
    # evaluated before, after the warm start and after the RL step
    assert [step for step, *_ in summary["held_out"]["arith"]["curve"]] == [0, 2, 3]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [("demonstrations" in r) for r in steps] == [True, True, False]
    with Store(run_dir / "store.sqlite") as store:
        demos = {s.session_id for s in store.sessions() if DEMONSTRATION in s.metadata}
        turns = store.turns(turn_type=TurnType.MAIN)
    assert len(demos) == 4
    # demonstrations are never judged as rollouts; rollouts start with the warm start's
    # adapter (v2; the ones the last step's publish overtook carry v3)
    assert all(t.judgement is None for _, t in turns if t.session_id in demos)
    rollouts = [t.policy_version for _, t in turns if t.session_id not in demos]
    assert rollouts[0] == 2 and set(rollouts) <= {2, 3}


def test_the_first_rl_rollouts_play_beside_the_switchs_evaluation(tmp_path):
    run_dir = tmp_path / "warm"
    # six greedy evaluation episodes one after another (no pass@k samples): the rollout
    # loop, started before them, has its first group under way long before the last begins
    overrides = ("eval.episodes=6", "eval.parallel=1", "eval.before=false", "eval.pass_k=0")
    train(run_dir, *WARM_START, *overrides, "trainer.max_steps=1")
    with Store(run_dir / "store.sqlite") as store:
        sessions = [store.session(s.session_id) for s in store.sessions()]
    switch = [
        s.created_at
        for s in sessions
        if s.env_id == "eval/arith" and s.turns and s.turns[0].policy_version == 2
    ]
    rollouts = [s.created_at for s in sessions if s.group_id is not None and s.env_id == "arith"]
    assert len(switch) == 6 and rollouts
    assert min(rollouts) < max(switch)


def test_a_run_stopped_during_the_switchs_evaluation_takes_it_up_on_resume(tmp_path):
    run_dir = tmp_path / "warm"
    command = [*WARM_START, "trainer.max_steps=0"]
    first = train(run_dir, *command)
    assert first["held_out"]["arith"]["switch"]["step"] == 2
    # a stop during the switch's evaluation: its checkpoint is there, its rows are not
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    kept = [r for r in rows if not ("eval_pass_at_1" in r and r["step"] == 2)]
    assert len(kept) < len(rows)
    metrics.write_text("".join(json.dumps(r) + "\n" for r in kept))
    # resumed for one RL step (the random tiny model scores 0 everywhere: trained at
    # advantage 0), so that the evaluation at its end cannot stand in for the switch's
    rl_step = [
        "trainer.max_steps=1",
        "method.filter_groups=false",
        "rollout.max_signalless_groups=0",
    ]
    resumed = train(run_dir, *command, *rl_step)
    held_out = resumed["held_out"]["arith"]
    assert held_out["switch"] is not None and held_out["switch"]["step"] == 2
    assert [step for step, *_ in held_out["curve"]] == [0, 2, 3]
    # the same policy version played those episodes to their end: taken back, not replayed
    assert held_out["switch"]["pass_at_1"] == first["held_out"]["arith"]["switch"]["pass_at_1"]


# Arith-v0 whose answers are never right (tests/trainers/faulty_envs.py): its reference
# agent plays every task to the end and fails it, as a broken tokenizer made every
# demonstration of the main job fail (issue 38).
FAULTY = "tests.trainers.faulty_envs:clawgym-test/Faulty-v0"
NEVER = {"fault": "never", "max_turns": 2}
NEVER_FAILED = (
    "all 3 demonstrations of env 'never' failed (the first: the env ended it (terminated) "
    "with reward 0.00, not above sft.min_outcome_reward=0.0)"
)


def never_solving_run(method: str, warm_start_steps: int) -> RunConfig:
    config = RunConfig(env={"never": EnvConfig(id=FAULTY, kwargs=NEVER, group_size=2)})
    config.model.name = "tiny"
    config.sampling.max_tokens = 8
    config.judge.kind = "env"
    config.method.name = method
    config.sft.episodes = 3
    config.sft.warm_start_steps = warm_start_steps
    config.trainer.batch_turns = 2
    config.trainer.lora_rank = 4
    return config


@pytest.mark.parametrize(("method", "warm_start_steps"), [("binary", 2), ("sft", 0)])
def test_a_run_whose_demonstrations_all_fail_stops_before_any_rl(
    tmp_path, method, warm_start_steps
):
    """A warm start (or an SFT run) on demonstrations that all failed would teach nothing:
    the run stops naming the env, the count and the first failure, before any rollout; a
    resumed run finds them so in its store and stops the same way."""
    from trainers.run import train as train_in_process

    config = never_solving_run(method, warm_start_steps)
    for _ in ("recorded", "resumed"):
        with pytest.raises(DemonstrationsFailed) as stopped:
            train_in_process(config, tmp_path)
        assert NEVER_FAILED in str(stopped.value)
    with Store(tmp_path / "store.sqlite") as store:
        sessions = store.sessions()
        assert store.count_turns(TurnStatus.TRAINED) == 0
    assert len(sessions) == 3 and all(DEMONSTRATION in s.metadata for s in sessions)


def test_the_first_failure_is_the_error_that_cut_a_demonstration_short():
    broken = EpisodeSummary(
        "s1",
        "t1",
        0.0,
        0,
        0,
        0,
        False,
        SessionStatus.FAILED,
        "the chat template never ends an assistant turn with '<|im_start|>'",
    )
    unsolved = dataclasses.replace(broken, session_id="s2", terminated=True, error=None)
    assert failures({"arith": [broken, unsolved]}, 0.0) == (
        "all 2 demonstrations of env 'arith' failed (the first: the chat template never ends "
        "an assistant turn with '<|im_start|>')"
    )
    message = str(DemonstrationsFailed(failures({"arith": [unsolved], "toolcall": [broken]}, 0.0)))
    assert message.startswith(
        "all 1 demonstrations of env 'arith' failed (the first: the env ended it (terminated) "
        "with reward 0.00, not above sft.min_outcome_reward=0.0); all 1 demonstrations of env "
        "'toolcall' failed (the first: the chat template"
    )
    assert "sft.warm_start_steps=0" in message  # the way around it


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    return Learner("tiny", TrainerConfig(lora_rank=4), tmp_path_factory.mktemp("learner"))


def prepare(store, learner, **playing):
    makes = {
        name: functools.partial(gym.make, env_id, **kwargs)
        for name, (env_id, kwargs) in playing.items()
    }
    prepare_demonstrations(SFTConfig(episodes=3), makes, store, learner, "tiny", 0, None)


def no_publish(adapter, version):
    """These SFT loops only read their demonstrations: nothing is published."""


ARITH = ("clawgym/Arith-v0", {"split": "train"})
CHAT = ("clawgym/Chat-v0", {"split": "train"})


def test_an_env_whose_demonstrations_all_fail_beside_one_that_demonstrates_is_named(
    tmp_path, learner, caplog
):
    with Store(tmp_path / "store.sqlite") as store, caplog.at_level(logging.WARNING):
        prepare(store, learner, arith=ARITH, never=(FAULTY, NEVER), chat=CHAT)
        sft = SFTLoop(TrainerConfig(), SFTConfig(), learner, store, no_publish, Progress(), None, 0)
        assert len(sft.demonstrations()) == 6  # arith's three, two turns each
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(NEVER_FAILED in w and "other envs' demonstrations train" in w for w in warnings)
    assert any("no demonstrations of chat" in w for w in warnings)


def test_an_env_without_a_reference_agent_alone_skips_a_warm_start(tmp_path, learner):
    with Store(tmp_path / "store.sqlite") as store:
        prepare(store, learner, chat=CHAT)  # no error: nothing was recorded to fail
        sft = SFTLoop(TrainerConfig(), SFTConfig(), learner, store, no_publish, Progress(), None, 0)
        with pytest.raises(NoDemonstrations, match="none of the run's envs has a reference"):
            sft.demonstrations()
    with Store(tmp_path / "mixed.sqlite") as store, pytest.raises(DemonstrationsFailed) as stopped:
        prepare(store, learner, never=(FAULTY, NEVER), chat=CHAT)
    assert str(stopped.value).startswith(NEVER_FAILED + ": nothing to imitate")
