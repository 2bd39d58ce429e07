"""The rollout loop's scheduling: what it plays at once."""

import threading

import pytest

from agents.config import EnvConfig, SamplingConfig
from agents.rollout import EpisodeSummary
from agents.trajectory import SessionStatus
from trainers.config import RolloutConfig, validate_rollout
from trainers.progress import Progress
from trainers.rollouts import EnvSlot, RolloutLoop, worth_replaying


class BarrierPlayer:
    """Finishes an episode only once `parties` episodes are in flight together: a loop that
    plays them one group after another breaks the barrier (its wait times out)."""

    def __init__(self, parties: int):
        self.barrier = threading.Barrier(parties, timeout=10)
        self.played: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def play(self, slot, task_id, group_id, seed, sampling):
        self.barrier.wait()
        with self._lock:
            self.played.append((group_id, seed))
        summary = EpisodeSummary(
            session_id=f"s{seed}",
            task_id=task_id,
            total_reward=1.0,
            turns=1,
            prompt_tokens=5,
            completion_tokens=3,
            terminated=True,
            status=SessionStatus.DONE,
        )
        return summary, 0.0

    def close(self):
        pass


def arith_loop(player, config, group_size=2, task_ids=("a", "b", "c", "d")):
    """A rollout loop over one Arith-v0 slot with these task ids, played by `player`."""
    slot = EnvSlot("arith", EnvConfig(id="clawgym/Arith-v0", group_size=group_size), make=None)
    slot.task_ids = list(task_ids)
    return RolloutLoop(
        config,
        {"arith": slot},
        player,
        SamplingConfig(),
        seed=0,
        progress=Progress(),
        has_room=lambda: True,
    )


def test_play_groups_plays_groups_in_flight_groups_at_once_and_returns():
    groups, size = 3, 2
    player = BarrierPlayer(groups * size)
    loop = arith_loop(player, RolloutConfig(groups_in_flight=groups), group_size=size)
    slot = loop.slots["arith"]
    summaries = loop.play_groups()
    assert len(summaries) == groups * size and not player.barrier.broken
    assert len({group for group, _ in player.played}) == groups
    assert slot.groups == groups  # the next call plays the next tasks


class ScriptedPlayer:
    """Ends each episode with the next status of `script` (then `done`), as a player whose
    policy server fails now and then would."""

    def __init__(self, script):
        self.script = list(script)
        self._lock = threading.Lock()

    def play(self, slot, task_id, group_id, seed, sampling):
        with self._lock:
            status = self.script.pop(0) if self.script else SessionStatus.DONE
        interrupted = status == SessionStatus.INTERRUPTED
        summary = EpisodeSummary(
            session_id=f"s{seed}",
            task_id=task_id,
            total_reward=0.0 if interrupted else 1.0,
            turns=1,
            prompt_tokens=5,
            completion_tokens=3,
            terminated=not interrupted,
            status=status,
            error="the episode broke off: InternalServerError: 502" if interrupted else None,
        )
        return summary, 0.0

    def close(self):
        pass


def scripted_loop(script, max_empty_episodes):
    config = RolloutConfig(groups_in_flight=1, max_empty_episodes=max_empty_episodes)
    return arith_loop(ScriptedPlayer(script), config, task_ids=("a", "b"))


def test_an_interrupted_episode_is_counted_and_the_loop_plays_on():
    down = SessionStatus.INTERRUPTED
    loop = scripted_loop([down, SessionStatus.DONE, down], max_empty_episodes=3)
    played = loop.play_groups() + loop.play_groups()  # no 3 in a row, whatever the order
    assert sorted(s.status for s in played) == ["done", "done", "interrupted", "interrupted"]
    recorded = loop.progress.env("arith").unreported()
    assert sorted(e.status for e in recorded) == ["done", "done", "interrupted", "interrupted"]


def test_a_server_that_stays_down_stops_the_loop_saying_why():
    loop = scripted_loop([SessionStatus.INTERRUPTED] * 8, max_empty_episodes=3)
    loop.play_groups()  # two in a row
    with pytest.raises(RuntimeError) as stopped:
        loop.run(threading.Event())
    message = str(stopped.value)
    assert "3 episodes in a row gave nothing to train on" in message
    assert "the last (arith): the episode broke off: InternalServerError: 502" in message


def summary(reward, status=SessionStatus.DONE):
    return EpisodeSummary(
        session_id="s",
        task_id="t",
        total_reward=reward,
        turns=1,
        prompt_tokens=5,
        completion_tokens=3,
        terminated=status == SessionStatus.DONE,
        status=status,
    )


def test_a_group_is_worth_replaying_when_its_rewards_differ_and_replays_are_left():
    split, solved, failed = [summary(1.0), summary(0.0)], [summary(1.0)] * 2, [summary(0.0)] * 2
    assert worth_replaying(split, plays_before=0, limit=1)
    assert worth_replaying(split, plays_before=1, limit=2)
    assert not worth_replaying(split, plays_before=1, limit=1)  # replayed as often as allowed
    assert not worth_replaying(split, plays_before=0, limit=0)  # replays off
    assert not worth_replaying(solved, plays_before=0, limit=2)
    assert not worth_replaying(failed, plays_before=0, limit=2)
    # a reward next to an episode that broke off says nothing of the policy
    broken = [summary(1.0), summary(0.0, SessionStatus.INTERRUPTED)]
    assert not worth_replaying(broken, plays_before=0, limit=2)


class TaskRewardPlayer:
    """Task "a" is solved by the even seeds only (its groups' rewards differ); every other
    task by none. Records the tasks in the order their groups played them."""

    def __init__(self):
        self.tasks = []

    def play(self, slot, task_id, group_id, seed, sampling):
        if not self.tasks or self.tasks[-1][1] != group_id:
            self.tasks.append((task_id, group_id))
        reward = 1.0 if task_id == "a" and seed % 2 == 0 else 0.0
        return summary(reward), 0.0

    def close(self):
        pass


@pytest.mark.parametrize(("replays", "order"), [(0, "abcd"), (1, "aabc"), (2, "aaab")])
def test_a_task_whose_group_split_is_played_again_before_fresh_tasks(replays, order):
    player = TaskRewardPlayer()
    loop = arith_loop(player, RolloutConfig(groups_in_flight=1, replay_informative=replays))
    slot = loop.slots["arith"]
    for _ in range(4):
        loop.play_group()
    assert "".join(task for task, _ in player.tasks) == order
    assert len({group for _, group in player.tasks}) == 4  # a replay is a group of its own
    assert slot.groups == 4 and slot.fresh == len(set(order))
    replayed_groups = len(order) - len(set(order))
    assert sum(e.replay for e in loop.progress.env("arith").episodes) == 2 * replayed_groups


def test_replay_informative_below_zero_is_refused():
    with pytest.raises(ValueError, match="rollout.replay_informative must be >= 0, got -1"):
        validate_rollout(RolloutConfig(replay_informative=-1))
