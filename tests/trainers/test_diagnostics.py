import math

import pytest
import torch

from agents.config import EnvConfig
from agents.store import Store
from agents.trajectory import Judgement, Session, SessionStatus
from tests.agents.test_trajectory import make_turn
from tests.trainers.test_learner import COMPLETION, PROMPT, make_learner, sample
from trainers.config import MethodConfig, TrainerConfig
from trainers.diagnostics import RewardGroups, mean_abs, nonzero_share, variance_share
from trainers.learner import Learner
from trainers.losses import entropy, k3_kl, k3_kl_of_scored, spread_positions
from trainers.metrics import MetricsWriter, read_metrics, step_rows
from trainers.progress import Progress, learning_health
from trainers.samples import RewardWeights
from trainers.training import TrainLoop

LN = math.log


# -- the formulas, on hand-computed values ---------------------------------------------------


def test_the_k3_estimate_on_two_tokens():
    # policy 0.5 and 0.25, reference 0.25 and 0.5: d = ln 0.5, then ln 2;
    # exp(d) - d - 1 = (0.5 + ln 2 - 1) + (2 - ln 2 - 1) = 0.5 over 2 tokens
    policy = torch.tensor([[LN(0.5), LN(0.25)]])
    reference = torch.tensor([[LN(0.25), LN(0.5)]])
    assert k3_kl(policy, reference, torch.ones(1, 2), 2).item() == pytest.approx(0.25)
    assert k3_kl(policy, policy, torch.ones(1, 2), 2).item() == 0.0
    masked = k3_kl(policy, reference, torch.tensor([[1.0, 0.0]]), 1).item()
    assert masked == pytest.approx(LN(2) - 0.5)


def test_the_k3_estimate_reads_only_the_rows_it_has_references_for():
    policy = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    # row 1's first token alone: d = -1.5 - (-1) = -0.5; exp(-0.5) + 0.5 - 1 over 2 tokens
    scored = [None, torch.tensor([-1.5])]
    estimate = k3_kl_of_scored(policy, scored, torch.ones(2, 2), 2)
    assert estimate == pytest.approx((math.exp(-0.5) - 0.5) / 2)
    assert k3_kl_of_scored(policy, [None, None], torch.ones(2, 2), 2) == 0.0


def test_the_turns_an_estimate_reads_are_spread_from_the_first():
    assert spread_positions(16, 4) == [0, 4, 8, 12]
    assert spread_positions(5, 2) == [0, 2]
    assert spread_positions(3, 4) == [0, 1, 2]  # fewer turns than wanted: all
    assert spread_positions(3, 0) == [0, 1, 2]  # 0: all
    assert spread_positions(0, 4) == []


def test_the_entropy_of_known_three_way_distributions():
    logprobs = torch.log(torch.tensor([[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]]))
    # 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2; the uniform one's is ln 3, the most of three
    assert entropy(logprobs).tolist() == pytest.approx([1.5 * LN(2), LN(3)])
    peaked = torch.log_softmax(torch.tensor([30.0, 0.0, 0.0]), dim=-1)
    assert 0 < entropy(peaked).item() < 1e-10


def test_the_variance_share_counts_groups_whose_rewards_differ():
    assert variance_share([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]]) == pytest.approx(1 / 3)
    assert variance_share([[1.0], [0.0, 0.5]]) == 1.0  # a group of one has no variance
    assert variance_share([[1.0]]) is None
    assert variance_share([]) is None


def test_the_nonzero_share_and_mean_absolute_advantage_of_trained_turns():
    advantages = [(0.0, 0.0), (0.5, 0.0), (-1.0,)]
    assert nonzero_share(advantages) == pytest.approx(2 / 3)
    assert mean_abs(advantages) == pytest.approx(1.5 / 5)
    assert nonzero_share([]) is None and mean_abs([]) is None


def test_reward_groups_count_each_group_once_whichever_poll_saw_it():
    groups = RewardGroups()
    groups.see([("a", 1, 1.0), ("a", 2, 1.0)])  # dropped at this poll, before the step
    groups.see([("b", 3, 0.0), ("b", 4, 1.0), ("c", 5, 0.0), ("c", 6, None)])
    assert sorted(groups.take()) == [[0.0], [0.0, 1.0], [1.0, 1.0]]
    groups.see([("c", 5, 0.0), ("c", 6, None), ("d", 7, 0.5), ("d", 8, 0.5)])  # c left over
    assert groups.take() == [[0.5, 0.5]]
    assert groups.taken == {"c", "d"}
    groups.see([("e", 9, 1.0)])  # c and d trained: forgotten
    assert groups.taken == set()


# -- the learner's figures, on the tiny model ------------------------------------------------


def test_a_step_reports_entropy_and_the_kl_to_the_weights_rl_started_from(tmp_path):
    learner = make_learner(tmp_path)
    first = learner.step([sample()])
    assert first.entropy is not None and 0 < first.entropy <= LN(2054) + 1e-4  # tiny's vocab
    assert first.kl_to_start == pytest.approx(0.0, abs=1e-6)  # the weights it starts from
    second = learner.step([sample()])
    assert second.kl_to_start is not None and second.kl_to_start > 1e-4
    assert math.isfinite(second.entropy or math.nan)


def test_after_an_sft_warm_start_the_kl_is_to_the_adapter_at_the_switch(tmp_path):
    learner = make_learner(tmp_path)
    imitation = learner.step([sample()], objective="nll")
    assert imitation.kl_to_start is None  # RL has not started
    assert imitation.entropy is not None and imitation.entropy > 0
    assert imitation.clip_fraction == 0.0
    switch = learner.step([sample()])
    assert switch.kl_to_start == pytest.approx(0.0, abs=1e-6)
    assert (learner.step([sample()]).kl_to_start or 0.0) > 1e-4


def test_the_kl_estimate_reads_the_spread_turns_alone(tmp_path):
    # four turns of one length (kept in order), told apart by their last prompt token and
    # their completions; the estimate of a step that reads two of them equals that of a
    # step on those two alone, from the same weights (it scores the policy before the step)
    turns = [
        sample(seq=i, prompt=(*PROMPT[:-1], 40 + i), completion=(50 + i, 60 + i, 12))
        for i in range(4)
    ]
    figures = {}
    for name, reads, batch in (
        ("two of four", 2, turns),
        ("those two", 0, [turns[0], turns[2]]),
        ("all four", 0, turns),
    ):
        learner = make_learner(tmp_path / name, kl_estimate_turns=reads)
        learner.step([sample()])  # RL's start, then a step away from it
        learner.step([sample()])
        figures[name] = learner.step(batch).kl_to_start
    assert figures["two of four"] == pytest.approx(figures["those two"], rel=1e-5)
    assert figures["two of four"] != pytest.approx(figures["all four"], rel=1e-3)


def test_the_kl_estimate_is_optional_and_survives_a_resume(tmp_path):
    off = make_learner(tmp_path / "off", kl_estimate=False)
    assert off.step([sample()]).kl_to_start is None and off.start_weights is None
    learner = make_learner(tmp_path / "on")
    learner.step([sample()])
    learner.save_checkpoint({})
    resumed = make_learner(tmp_path / "on", seed=1)
    resumed.load_checkpoint()
    assert learner.start_weights is not None and resumed.start_weights is not None
    for name, weight in learner.start_weights.items():
        assert torch.equal(resumed.start_weights[name], weight)
    assert resumed.step([sample()]).kl_to_start == pytest.approx(
        learner.step([sample()]).kl_to_start, rel=1e-4
    )


@pytest.mark.parametrize("micro_batch_tokens", [16, 10_000])
def test_the_clip_fraction_is_token_weighted_against_the_rollout(tmp_path, micro_batch_tokens):
    learner = make_learner(tmp_path, micro_batch_tokens=micro_batch_tokens)
    long, short = COMPLETION * 2, (90, 91)
    on_policy = tuple(learner.logprobs(PROMPT, long))  # ratio 1: inside the range
    far = tuple(lp - 1.0 for lp in learner.logprobs(PROMPT, short))  # ratio e: clipped
    metrics = learner.step(
        [
            sample(seq=1, completion=long, rollout=on_policy),
            sample(2, completion=short, rollout=far),
        ]
    )
    assert metrics.clip_fraction == pytest.approx(2 / 12)  # not (0 + 1) / 2 micro-batches


# -- the training loop's row -----------------------------------------------------------------


def add_group(store, name, outcomes):
    """A finished group of one-turn episodes of env "e", judged, with these outcomes."""
    for i, outcome in enumerate(outcomes):
        session_id = f"{name}-{i}"
        store.add_session(Session(session_id, "e", task_id="t", group_id=name))
        store.add_turn(make_turn(session_id=session_id))
        store.finish_session(session_id, outcome, SessionStatus.DONE, "terminated")
        store.set_judgement(session_id, 0, Judgement(score=outcome))


def test_a_steps_row_counts_the_groups_filtered_before_it(tmp_path):
    torch.manual_seed(0)
    trainer = TrainerConfig(lora_rank=4, lora_alpha=8, batch_turns=2)
    progress = Progress()
    with Store(tmp_path / "store.sqlite") as store:
        metrics = MetricsWriter(tmp_path)
        train = TrainLoop(
            trainer,
            MethodConfig(filter_groups=True),
            {"e": EnvConfig(group_size=2)},
            {"e": RewardWeights(0.0, 1.0)},
            Learner("tiny", trainer, tmp_path),
            store,
            lambda adapter, version: None,
            progress,
            metrics,
            tmp_path,
        )
        add_group(store, "u1", [0.0, 0.0])
        add_group(store, "u2", [1.0, 1.0])
        assert train.step() is None  # both uniform: dropped, no step
        add_group(store, "g", [1.0, 0.0])
        assert train.step() is not None
        metrics.close()
    (row,) = step_rows(read_metrics(tmp_path))
    assert row["group_variance_share"] == pytest.approx(1 / 3)
    assert row["nonzero_advantage_share"] == 1.0
    assert row["mean_abs_advantage"] == pytest.approx(0.5)  # rewards 1 and 0 about 0.5
    assert row["kl_to_start"] == pytest.approx(0.0, abs=1e-6) and row["entropy"] > 0
    assert {"clip_fraction", "grad_norm"} <= row.keys()
    shown = learning_health(progress)  # the progress bar's
    assert shown.startswith(" | varied groups 33% | entropy ") and " | kl 0.0000" in shown
