import pytest
import torch

from agents.config import EnvConfig
from agents.store import Store
from agents.trajectory import Judgement, Session, SessionStatus
from tests.agents.test_trajectory import make_turn
from trainers.config import MethodConfig, TrainerConfig
from trainers.learner import Learner
from trainers.metrics import MetricsWriter, read_metrics
from trainers.progress import Progress
from trainers.samples import GroupSignal, RewardWeights
from trainers.training import SignalWatch, TrainLoop


def group(env="arith", signal=False, rewards=(0.0,), name="g"):
    return GroupSignal(name, env, signal, rewards, f"{name}-first")


def test_the_watch_stops_a_run_of_signal_less_groups_of_one_env():
    watch = SignalWatch(3, lambda session: f"done (max_turns) [{session}]")
    watch.see(group(name="g1"))
    watch.see(group(name="g2"))
    with pytest.raises(RuntimeError) as stopped:
        watch.see(group(name="g3"))
    message = str(stopped.value)
    assert "env 'arith': 3 groups in a row scored the same (every reward 0.0)" in message
    # the first group of the run is the one described
    assert "first episode ended done (max_turns) [g1-first]" in message
    assert "rollout.max_signalless_groups=0" in message


def test_a_group_with_a_signal_starts_the_count_again_and_envs_count_apart():
    watch = SignalWatch(2, lambda session: "done")
    watch.see(group())
    watch.see(group(signal=True))
    watch.see(group())  # one in a row again
    watch.see(group(env="chat"))  # another env's run is its own
    assert watch.counts == {"arith": 1, "chat": 1}
    with pytest.raises(RuntimeError, match="env 'chat': 2 groups"):
        watch.see(group(env="chat", rewards=(1.0,)))


def test_the_message_names_rewards_equal_at_each_step_and_missing_hints():
    watch = SignalWatch(1, lambda session: "done", hints=True)
    with pytest.raises(
        RuntimeError, match=r"rewards -1.0, 1.0, each equal to its step's mean, no hint"
    ):
        watch.see(group(rewards=(-1.0, 1.0)))
    with pytest.raises(RuntimeError, match="no turn had a reward"):
        SignalWatch(1, lambda session: "done").see(group(rewards=()))


def test_a_limit_of_zero_never_stops():
    watch = SignalWatch(0, lambda session: "done")
    for _ in range(100):
        watch.see(group())
    assert watch.counts == {"arith": 100}


# -- the training loop on a real store and the tiny model ------------------------------------


def add_group(store, name, outcomes, reason="max_turns"):
    """A finished group of one-turn episodes of env "e", judged, with these outcomes."""
    for i, outcome in enumerate(outcomes):
        session_id = f"{name}-{i}"
        store.add_session(Session(session_id, "e", task_id="t", group_id=name))
        store.add_turn(make_turn(session_id=session_id))
        store.set_next_state(session_id, 0, [{"role": "user", "content": "incorrect  answer"}])
        store.finish_session(session_id, outcome, SessionStatus.DONE, reason)
        store.set_judgement(session_id, 0, Judgement(score=outcome))


@pytest.fixture
def loop(tmp_path):
    def make(batch_turns=2, filter_groups=True, max_signalless_groups=0):
        torch.manual_seed(0)
        trainer = TrainerConfig(lora_rank=4, lora_alpha=8, batch_turns=batch_turns)
        store = Store(tmp_path / "store.sqlite")
        metrics = MetricsWriter(tmp_path)
        train = TrainLoop(
            trainer,
            MethodConfig(filter_groups=filter_groups),
            {"e": EnvConfig(group_size=2)},
            {"e": RewardWeights(0.0, 1.0)},
            Learner("tiny", trainer, tmp_path),
            store,
            lambda adapter, version: None,
            Progress(),
            metrics,
            tmp_path,
            max_signalless_groups=max_signalless_groups,
        )
        made.append((store, metrics))
        return train

    made: list[tuple[Store, MetricsWriter]] = []
    yield make
    for store, metrics in made:
        metrics.close()
        store.close()


def statuses(store):
    return {t.session_id: str(t.status) for _, t in store.turns()}


@pytest.mark.parametrize("filter_groups", [True, False])
def test_a_backlog_of_signal_free_groups_leaves_the_rollout_room(loop, filter_groups):
    # a backlog of two batches (4 turns): full with two groups that scored the same and one
    # that did not, as while the learner is busy and takes no step
    train = loop(batch_turns=2, filter_groups=filter_groups)
    for name, outcomes in [("u1", [0.0, 0.0]), ("g", [1.0, 0.0]), ("u2", [1.0, 1.0])]:
        add_group(train.store, name, outcomes)
    assert train.waiting() == 6
    # filtered, the uniform groups will never be trained: dropped, they make room; unfiltered
    # they are a batch's turns at advantage 0 and hold their place
    assert train.has_room() is filter_groups
    dropped = {"u1-0", "u1-1", "u2-0", "u2-1"} if filter_groups else set()
    assert {s for s, status in statuses(train.store).items() if status == "dropped"} == dropped
    assert train.progress.turns_dropped == len(dropped)
    assert train.has_room() is filter_groups  # nothing new judged: no second pruning
    # the step that follows counts the groups the pruning dropped as filtered
    assert train.step() is not None
    rows = read_metrics(train.run_dir)
    assert rows[0]["filtered_groups"] == (2 if filter_groups else 0)


def test_a_filtering_step_drops_uniform_groups_and_waits_for_groups_with_a_signal(loop, tmp_path):
    train = loop(batch_turns=2)
    add_group(train.store, "u1", [0.0, 0.0])
    add_group(train.store, "u2", [1.0, 1.0])
    assert train.step() is None  # both filtered: nothing to train yet
    assert set(statuses(train.store).values()) == {"dropped"}
    assert train.waiting() == 0  # the rollout has room to play on
    add_group(train.store, "g", [1.0, 0.0])
    metrics = train.step()
    assert metrics is not None and metrics.turns == 2
    assert statuses(train.store) == {
        "u1-0": "dropped",
        "u1-1": "dropped",
        "u2-0": "dropped",
        "u2-1": "dropped",
        "g-0": "trained",
        "g-1": "trained",
    }
    rows = read_metrics(tmp_path)
    assert [(r.get("env"), r["filtered_groups"]) for r in rows] == [(None, 2), ("e", 2)]


def test_without_filtering_a_step_takes_whole_groups_in_order(loop, tmp_path):
    train = loop(batch_turns=4, filter_groups=False)
    add_group(train.store, "u", [0.0, 0.0])
    add_group(train.store, "g", [1.0, 0.0])
    add_group(train.store, "later", [1.0, 0.0])
    metrics = train.step()
    assert metrics is not None and metrics.turns == 4
    assert statuses(train.store) == {
        "u-0": "trained",
        "u-1": "trained",
        "g-0": "trained",
        "g-1": "trained",
        "later-0": "judged",  # left whole for the next step
        "later-1": "judged",
    }
    assert [r["filtered_groups"] for r in read_metrics(tmp_path)] == [0, 0]


def test_the_loop_stops_on_a_run_of_signal_less_groups_naming_how_it_began(loop):
    train = loop(batch_turns=4, max_signalless_groups=3)
    add_group(train.store, "u1", [0.0, 0.0], reason="max_turns")
    add_group(train.store, "g", [1.0, 0.0])  # left judged: a batch is 4 turns
    assert train.step() is None
    add_group(train.store, "u2", [0.0, 0.0], reason="terminated")
    add_group(train.store, "u3", [0.0, 0.0])
    assert train.step() is None  # g seen once: still two in a row
    add_group(train.store, "u4", [0.0, 0.0])
    with pytest.raises(RuntimeError) as stopped:
        train.step()
    message = str(stopped.value)
    assert "env 'e': 3 groups in a row scored the same (every reward 0.0)" in message
    assert "ended done (terminated), last observation 'incorrect answer'" in message


def test_an_interrupted_episode_is_never_trained_and_leaves_its_group_to_the_others(loop, tmp_path):
    train = loop(batch_turns=2)
    add_group(train.store, "g", [1.0, 0.0])
    # the group's third rollout lost its server after a turn: no fault of the policy's
    train.store.add_session(Session("g-2", "e", task_id="t", group_id="g"))
    train.store.add_turn(make_turn(session_id="g-2"))
    train.store.finish_session("g-2", 0.0, SessionStatus.INTERRUPTED, "the server failed")
    assert statuses(train.store)["g-2"] == "dropped"
    metrics = train.step()
    assert metrics is not None and metrics.turns == 2
    assert statuses(train.store) == {"g-0": "trained", "g-1": "trained", "g-2": "dropped"}
    # the baseline is the two played episodes' mean (0.5), not the three's (1/3)
    assert read_metrics(tmp_path)[0]["mean_abs_advantage"] == pytest.approx(0.5)
