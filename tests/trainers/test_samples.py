import base64

import pytest

from agents.config import EnvConfig
from agents.trajectory import Judgement, Session, SessionStatus
from tests.agents.test_trajectory import make_turn
from tests.agents.test_vision import png
from trainers.config import MethodConfig
from trainers.judge import HINT_HEADER
from trainers.learning import TrainSample
from trainers.samples import RewardWeights, first_batch, reward_weights, select, turn_reward

ROLLOUT = (-1.0, -2.0)


def turn(session, index=0, score=None, teacher=None, version=3):
    judgement = (
        None if score is None else Judgement(votes=(), score=score, teacher_logprobs=teacher)
    )
    return make_turn(
        session_id=session,
        index=index,
        completion_logprobs=ROLLOUT,
        judgement=judgement,
        policy_version=version,
    )


def sessions(*specs):
    return {
        sid: Session(sid, "e", group_id=group, outcome_reward=outcome, status=SessionStatus.DONE)
        for sid, group, outcome in specs
    }


def run(judged, found, method="binary", weights=None, encode=None, **changes):
    config = MethodConfig(name=method, **changes)
    return select(
        judged,
        found,
        config,
        weights=weights or {"e": reward_weights(EnvConfig(), config, "self")},
        current_version=3,
        max_staleness=1,
        encode=encode,
    )


def fake_encode(messages, tools):
    """Stands in for an engine's `encode` (no chat template needed to test the dispatch):
    the characters of the last message's content."""
    return [ord(c) for c in messages[-1]["content"]]


TOP = {
    "completion_top_ids": ((4, 9, 1), (5, 4, 2)),
    "completion_top_logprobs": ((-0.5, -1.0, -3.0), (-1.25, -1.5, -2.0)),
}


def hinted(score, hint, top=TOP):
    judgement = Judgement(votes=(), score=score, hint=hint, teacher_logprobs=hint and (-1.0, -1.0))
    return make_turn(
        session_id="x", completion_logprobs=ROLLOUT, judgement=judgement, policy_version=3, **top
    )


@pytest.mark.parametrize(
    ("method", "score", "hint", "advantage", "top_k"),
    [
        ("topk_combine", 1.0, "Answer in French.", 1.0, True),  # hint, +1: both terms
        ("topk_combine", 0.0, "Answer in French.", 0.0, True),  # hint, 0: top-k term only
        ("topk_combine", -1.0, None, -1.0, False),  # no hint: the reward alone
        ("topk_combine", 0.0, None, None, False),  # neither: dropped
        ("topk_opd", -1.0, "Answer in French.", 0.0, True),  # no reward term (w_rl 0)
        ("topk_opd", -1.0, None, None, False),
    ],
)
def test_top_k_methods_follow_combines_table_with_the_top_k_term(
    method, score, hint, advantage, top_k
):
    w_rl = 0.0 if method == "topk_opd" else 1.0
    found = sessions(("x", None, None))
    result = run([(1, hinted(score, hint))], found, method, encode=fake_encode, w_rl=w_rl, k=2)
    if advantage is None:
        assert result.samples == () and result.dropped == (1,)
        return
    (sample,) = result.samples
    assert sample.advantages == (advantage, advantage)
    if top_k:  # the hinted teacher's prompt, the old student's top-2 of each position
        assert sample.teacher_prompt_ids == tuple(ord(c) for c in "hi" + HINT_HEADER + hint)
        assert sample.top_ids == ((4, 9), (5, 4))
        assert sample.top_logprobs == ((-0.5, -1.0), (-1.25, -1.5))
    else:
        assert sample.teacher_prompt_ids is None and sample.top_ids == ()


def test_a_hinted_turn_stored_without_enough_top_k_trains_without_its_hint():
    found = sessions(("x", None, None))
    stored = hinted(-1.0, "Answer in French.", top={})
    result = run([(1, stored)], found, "topk_combine", encode=fake_encode)
    assert result.samples[0].teacher_prompt_ids is None
    assert result.samples[0].advantages == (-1.0, -1.0)
    with pytest.raises(ValueError, match="needs `encode`"):
        run([(1, stored)], found, "topk_combine")


def test_binary_centres_outcomes_within_a_group_at_each_step():
    found = sessions(("a", "g", 1.0), ("b", "g", 0.0), ("c", "g", 0.0), ("d", "g", 1.0))
    judged = [
        (1, turn("a")),
        (2, turn("b")),
        (3, turn("c")),
        (4, turn("d")),
        (5, turn("a", index=1)),
    ]
    result = run(judged, found, use_judge=False)
    advantages = {s.seq: s.advantages for s in result.samples}
    # step 0: mean 0.5; step 1 has one turn, which keeps its reward like any singleton
    assert advantages == {
        1: (0.5, 0.5),
        2: (-0.5, -0.5),
        3: (-0.5, -0.5),
        4: (0.5, 0.5),
        5: (1.0, 1.0),
    }
    found["e"] = Session("e", "e", group_id="h", outcome_reward=1.0)
    found["f"] = Session("f", "e", group_id="h", outcome_reward=1.0)
    uniform = run([(6, turn("e")), (7, turn("f"))], found, use_judge=False)
    assert uniform.samples == () and uniform.dropped == (
        6,
        7,
    )  # nothing to learn from a uniform group


def test_binary_live_turns_keep_the_judge_score_and_ties_are_masked():
    found = sessions(("x", None, None), ("y", None, None))
    judged = [
        (1, turn("x", score=1.0)),
        (2, turn("y", score=0.0)),
        (3, turn("x", index=1, score=-1.0)),
    ]
    result = run(judged, found)
    assert {s.seq: s.advantages[0] for s in result.samples} == {1: 1.0, 3: -1.0}
    assert result.dropped == (2,)


def test_a_turn_whose_image_cannot_be_read_is_dropped_and_an_admitted_one_trains():
    """The proxy refuses bad images, so only an imported turn can hold one: it is dropped,
    not a dead training loop. An image the proxy admitted trains at any size."""
    big = "data:image/png;base64," + base64.b64encode(png((40, 40)) + bytes(5 << 20)).decode()
    gif = "data:image/gif;base64,R0lGODlhAQABAAAAACw="
    found = sessions(("x", None, None), ("y", None, None))
    judged = [
        (1, turn("x", score=1.0).replace(prompt_messages=tuple(looking_at(big)))),
        (2, turn("y", score=-1.0).replace(prompt_messages=tuple(looking_at(gif)))),
    ]
    result = run(judged, found)
    assert [s.seq for s in result.samples] == [1] and result.dropped == (2,)
    assert len(result.samples[0].images[0]) > 4 << 20  # past the default limit


def looking_at(url):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]


def test_outcome_is_ignored_where_the_env_weighs_it_zero():
    found = sessions(("x", None, 0.0))
    no_outcome = RewardWeights(judge=1.0, outcome=0.0)
    assert turn_reward(turn("x", score=1.0), found["x"], no_outcome) == 1.0
    assert turn_reward(turn("x", score=1.0), found["x"], RewardWeights(1.0, 1.0)) == 1.0
    assert turn_reward(turn("x", score=0.0), found["x"], no_outcome) is None


def test_step_score_and_outcome_mix_with_the_env_weights():
    found = sessions(("x", None, 1.0))
    # 0.5 * judge (-1) + 2.0 * outcome (1) = 1.5
    assert turn_reward(turn("x", score=-1.0), found["x"], RewardWeights(0.5, 2.0)) == 1.5
    # a judge of 0 (a tie) is no signal; the outcome alone remains
    assert turn_reward(turn("x", score=0.0), found["x"], RewardWeights(0.5, 2.0)) == 2.0


def test_a_judge_that_is_the_outcome_counts_it_once():
    method = MethodConfig(use_judge=True, use_env_reward=True)
    assert reward_weights(EnvConfig(), method, "env") == RewardWeights(0.0, 1.0)
    assert reward_weights(EnvConfig(judge_weight=2.0), method, "env") == RewardWeights(0.0, 2.0)
    assert reward_weights(EnvConfig(), method, "self") == RewardWeights(1.0, 1.0)
    judge_off = MethodConfig(use_judge=False)
    assert reward_weights(EnvConfig(), judge_off, "env") == RewardWeights(0.0, 1.0)
    chat = EnvConfig(outcome_weight=0.0, judge_weight=2.0)
    assert reward_weights(chat, method, "self") == RewardWeights(2.0, 0.0)
    assert reward_weights(None, method, "self") == RewardWeights(1.0, 0.0)  # live


def test_the_env_judge_contrasts_a_failed_rollout_of_a_0_1_task_with_solved_ones():
    # the env judge scores a failure 0 (the sign of a 0 outcome): taken as the outcome, the
    # failure is a reward of 0 below its group's mean of 0.75, not a masked tie
    found = sessions(("a", "g", 1.0), ("b", "g", 1.0), ("c", "g", 1.0), ("d", "g", 0.0))
    scores = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0}
    judged = [(n, turn(sid, score=scores[sid])) for n, sid in enumerate("abcd", start=1)]
    weights = {"e": reward_weights(EnvConfig(), MethodConfig(), "env")}
    result = run(judged, found, weights=weights)
    advantages = {s.seq: s.advantages[0] for s in result.samples}
    assert advantages == pytest.approx({1: 0.25, 2: 0.25, 3: 0.25, 4: -0.75})


def test_each_session_takes_its_own_envs_weights_in_a_mixture():
    found = {
        "a": Session("a", "terminal", group_id="g", outcome_reward=1.0),
        "b": Session("b", "terminal", group_id="g", outcome_reward=0.0),
        "c": Session("c", "chat", group_id=None, outcome_reward=1.0),
    }
    weights = {"terminal": RewardWeights(0.0, 1.0), "chat": RewardWeights(1.0, 0.0)}
    judged = [(1, turn("a", score=1.0)), (2, turn("b", score=1.0)), (3, turn("c", score=-1.0))]
    result = run(judged, found, weights=weights)
    # terminal: outcomes 1 and 0 centred (judge weighed 0); chat: the judge's -1 alone
    assert {s.seq: s.advantages[0] for s in result.samples} == {1: 0.5, 2: -0.5, 3: -1.0}


def test_group_baseline_centres_over_all_the_groups_turns():
    found = sessions(("a", "g", 1.0), ("b", "g", 0.0))
    judged = [(1, turn("a")), (2, turn("a", index=1)), (3, turn("b"))]
    step = run(judged, found, use_judge=False)
    group = run(judged, found, use_judge=False, baseline="group")
    assert {s.seq: s.advantages[0] for s in step.samples} == {1: 0.5, 2: 1.0, 3: -0.5}
    # all three turns: mean 2/3
    assert {s.seq: round(s.advantages[0], 4) for s in group.samples} == {
        1: 0.3333,
        2: 0.3333,
        3: -0.6667,
    }


def test_opd_trains_only_hinted_turns_on_teacher_minus_rollout():
    found = sessions(("x", None, None))
    judged = [(1, turn("x", score=1.0, teacher=(-0.5, -2.5))), (2, turn("x", index=1, score=-1.0))]
    result = run(judged, found, method="opd")
    assert [(s.seq, s.advantages) for s in result.samples] == [(1, (0.5, -0.5))]
    assert result.dropped == (2,)


@pytest.mark.parametrize(
    ("score", "teacher", "expected"),
    [
        (1.0, (-0.5, -2.5), (1.5, 0.5)),
        (0.0, (-0.5, -2.5), (0.5, -0.5)),
        (-1.0, None, (-1.0, -1.0)),
        (0.0, None, None),
    ],
)
def test_combine_dispatch_on_stored_turns(score, teacher, expected):
    result = run(
        [(1, turn("x", score=score, teacher=teacher))],
        sessions(("x", None, None)),
        method="combine",
    )
    if expected is None:
        assert result.samples == () and result.dropped == (1,)
    else:
        assert result.samples[0].advantages == pytest.approx(expected)


def test_stale_turns_are_dropped_and_counted():
    found = sessions(("x", None, None))
    result = run(
        [(1, turn("x", score=1.0, version=1)), (2, turn("x", index=1, score=1.0, version=2))], found
    )
    assert [s.seq for s in result.samples] == [2]
    assert (result.dropped, result.stale) == ((1,), 1)


def test_a_step_takes_the_oldest_whole_baseline_groups():
    samples = [TrainSample(seq, (1,), (2,), (-1.0,), (0.5,), 0) for seq in range(7)]
    keys = {0: "a", 1: "a", 2: "b", 3: "a", 4: "b", 5: "c", 6: "c"}
    assert [s.seq for s in first_batch(samples, keys, 4)] == [0, 1, 3, 2, 4]
    assert [s.seq for s in first_batch(samples, keys, 3)] == [0, 1, 3]
    assert [s.seq for s in first_batch(samples, keys, 99)] == [0, 1, 3, 2, 4, 5, 6]


# Two groups of two rollouts: g contrasts a solved and a failed one, u failed both.
MIXED = (("a", "g", 1.0), ("b", "g", 0.0), ("c", "u", 0.0), ("d", "u", 0.0))
MIXED_TURNS = [(n, turn(sid)) for n, sid in enumerate("abcd", start=1)]


def test_filtered_groups_are_dropped_whole_and_reported_without_signal():
    result = run(MIXED_TURNS, sessions(*MIXED), use_judge=False)
    assert {s.seq: s.advantages[0] for s in result.samples} == {1: 0.5, 2: -0.5}
    assert result.dropped == (3, 4)
    assert [(g.group_id, g.signal, g.rewards, g.session_id) for g in result.groups] == [
        ("g", True, (0.0, 1.0), "a"),
        ("u", False, (0.0,), "c"),
    ]


def test_without_filtering_a_uniform_group_trains_at_advantage_zero():
    result = run(MIXED_TURNS, sessions(*MIXED), use_judge=False, filter_groups=False)
    assert {s.seq: s.advantages for s in result.samples} == {
        1: (0.5, 0.5),
        2: (-0.5, -0.5),
        3: (0.0, 0.0),
        4: (0.0, 0.0),
    }
    assert result.dropped == ()
    assert [g.signal for g in result.groups] == [True, False]  # the watch still sees it


def test_a_turn_alone_in_its_group_is_neither_filtered_nor_kept_at_zero():
    # a live turn and a group_size 1 episode: no variance to measure, so no group signal;
    # a zero reward trains on nothing with or without filtering
    found = sessions(("x", None, None), ("y", "solo", None))
    judged = [(1, turn("x", score=1.0)), (2, turn("y", score=0.0)), (3, turn("y", 1, 1.0))]
    for filtering in (True, False):
        result = run(judged, found, filter_groups=filtering)
        assert [s.seq for s in result.samples] == [1, 3] and result.dropped == (2,)
        assert result.groups == ()


def test_groups_are_listed_in_the_order_of_their_last_turn():
    judged = [(1, turn("c")), (2, turn("a")), (3, turn("b")), (4, turn("d"))]
    result = run(judged, sessions(*MIXED), use_judge=False)
    assert [g.group_id for g in result.groups] == ["g", "u"]


def test_a_group_with_equal_rewards_at_each_step_has_no_signal():
    # the judge scored step 0 well and step 1 badly in both rollouts: no contrast at any step
    found = sessions(("a", "g", None), ("b", "g", None))
    judged = [
        (1, turn("a", score=1.0)),
        (2, turn("b", score=1.0)),
        (3, turn("a", index=1, score=-1.0)),
        (4, turn("b", index=1, score=-1.0)),
    ]
    (group,) = run(judged, found).groups
    assert (group.signal, group.rewards) == (False, (-1.0, 1.0))


@pytest.mark.parametrize(
    ("method", "teacher", "signal"),
    [
        ("combine", (-0.5, -2.5), True),  # the teacher term still teaches
        ("combine", None, False),
        ("opd", (-0.5, -2.5), True),
        ("opd", None, False),
        ("binary", (-0.5, -2.5), False),  # binary never reads the hint
    ],
)
def test_a_uniform_group_has_a_signal_only_where_the_method_learns_from_a_hint(
    method, teacher, signal
):
    found = sessions(("a", "g", None), ("b", "g", None))
    judged = [(1, turn("a", score=1.0, teacher=teacher)), (2, turn("b", score=1.0))]
    result = run(judged, found, method=method)
    assert [g.signal for g in result.groups] == [signal]
    assert bool(result.samples) == signal
