"""The rollout loop's scheduling: what it plays at once."""

import threading

from agents.config import EnvConfig, SamplingConfig
from agents.rollout import EpisodeSummary
from agents.trajectory import SessionStatus
from trainers.config import RolloutConfig
from trainers.progress import Progress
from trainers.rollouts import EnvSlot, RolloutLoop


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


def test_play_groups_plays_groups_in_flight_groups_at_once_and_returns():
    groups, size = 3, 2
    slot = EnvSlot("arith", EnvConfig(id="clawgym/Arith-v0", group_size=size), make=None)
    slot.task_ids = ["a", "b", "c", "d"]
    player = BarrierPlayer(groups * size)
    loop = RolloutLoop(
        RolloutConfig(groups_in_flight=groups),
        {"arith": slot},
        player,
        SamplingConfig(),
        seed=0,
        progress=Progress(),
        has_room=lambda: True,
    )
    summaries = loop.play_groups()
    assert len(summaries) == groups * size and not player.barrier.broken
    assert len({group for group, _ in player.played}) == groups
    assert slot.groups == groups  # the next call plays the next tasks
