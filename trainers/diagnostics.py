"""What a step's rewards and advantages say about whether a run can learn: pure functions
behind the step's row of `metrics.jsonl` (the learner's own figures, the entropy and the KL
estimate, are per-token tensor maths in `trainers.losses`), and the tally of the reward
groups the training loop saw between two steps.

Read together: groups without reward variance give no advantage to learn from; a policy
whose entropy falls to ~0 has stopped exploring; a KL to the starting policy that stays 0
means the adapter is not moving.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence


def variance_share(groups: Iterable[Sequence[float]]) -> float | None:
    """Share of the reward groups of two or more members whose rewards are not all equal:
    those a group baseline turns into non-zero advantages. None: no such group (a group of
    one, such as a live conversation, has no variance to speak of)."""
    sized = [group for group in groups if len(group) > 1]
    if not sized:
        return None
    return sum(max(group) != min(group) for group in sized) / len(sized)


def nonzero_share(advantages: Sequence[Sequence[float]]) -> float | None:
    """Share of turns (each a sequence of per-token advantages) with a non-zero advantage on
    some token: a turn at 0 everywhere trains on nothing. None: no turn."""
    if not advantages:
        return None
    return sum(any(a != 0 for a in turn) for turn in advantages) / len(advantages)


def mean_abs(advantages: Sequence[Sequence[float]]) -> float | None:
    """Mean |advantage| over every token of the turns; None: no token."""
    tokens = [abs(a) for turn in advantages for a in turn]
    return sum(tokens) / len(tokens) if tokens else None


class RewardGroups:
    """The rewards of the baseline groups the training loop saw since its last step, each
    group counted at one step only.

    A group without signal is dropped (`method.filter_groups`) at whichever poll of the
    store first finds it complete, seldom the poll that then takes a step; so every poll's
    judged turns are seen (`see`) and each step takes what was seen since the last one
    (`take`). A group a step leaves for the next is not counted twice.
    """

    def __init__(self) -> None:
        self.pending: dict[Hashable, dict[int, float]] = {}
        """Groups seen and not yet taken: each turn's reward by its seq, by baseline key."""
        self.taken: set[Hashable] = set()
        """Taken groups that the last poll still held (left for a later step)."""

    def see(self, turns: Iterable[tuple[Hashable, int, float | None]]) -> None:
        """Counts one poll's judged turns, each as (baseline key, seq, reward); a turn
        without reward (no signal under the method) is no member of its group."""
        keys = set()
        for key, seq, reward in turns:
            keys.add(key)
            if key not in self.taken and reward is not None:
                self.pending.setdefault(key, {})[seq] = reward
        self.taken &= keys  # a group gone from the store's judged turns never comes back

    def take(self) -> list[list[float]]:
        """The rewards of each group seen since the last `take`."""
        groups = [list(rewards.values()) for rewards in self.pending.values()]
        self.taken |= self.pending.keys()
        self.pending = {}
        return groups
