"""Supervised fine-tuning (`method=sft`) on demonstrations, and RL that starts from its
adapter (`trainer.init_adapter`)."""

import json
from collections import Counter

import pytest
import torch

from agents.demonstrations import DEMONSTRATION
from agents.store import Store
from agents.trajectory import TurnType
from tests.trainers.test_run import train
from trainers.config import TrainerConfig
from trainers.learner import Learner
from trainers.sft import batch_order

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


def test_a_warm_start_takes_supervised_steps_then_rl_samples_from_their_adapter(tmp_path):
    run_dir = tmp_path / "warm"
    summary = train(
        run_dir,
        "env=arith",
        "method=binary",
        "env.arith.group_size=2",
        "env.arith.max_tokens=24",
        "sft.episodes=4",
        "sft.warm_start_steps=2",
        "sft.lr=2e-3",
        "trainer.batch_turns=4",
        "trainer.max_steps=1",
        "eval.episodes=2",
    )
    assert (summary["steps"], summary["adapter_version"]) == (3, 3)
    # evaluated before, after the warm start and after the RL step
    assert [step for step, _ in summary["held_out"]["arith"]["curve"]] == [0, 2, 3]
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
