"""Environments that fail on purpose, for the tests of a run that meets bad episodes. They
are registered on import, so a run names them as
`tests.trainers.faulty_envs:clawgym-test/Faulty-v0` (gymnasium's `module:id`), the way a
user's own environment is trained.

They stand in for failures that a real environment cannot be made to show on demand: a
sandbox that dies in a way its env cannot recover from (the bwrap and Docker sandboxes
restart a killed shell), tool output that floods the context, and a task no answer solves
(every rollout of a group scores the same, as under a policy that never solves).
"""

from __future__ import annotations

import gymnasium as gym

from envs.arith.env import ArithEnv
from envs.core import Reply


class SandboxDied(RuntimeError):
    """What a sandbox backend raises when its container or namespace is gone for good."""


class FaultyArith(ArithEnv):
    """Arith-v0 whose episodes fail on purpose.

    Args:
        fault: die (the step of the second turn of an odd-seeded episode raises, as a step
            whose sandbox died does), flood (turn n adds an observation of n times
            `flood_words` words: the history outgrows a small context, first so that
            eliding older output makes it fit, then so that nothing can) or never (no
            answer is ever right: every episode's outcome is 0).
        flood_words: words of the first flooding observation.
    """

    def __init__(self, fault: str = "die", flood_words: int = 100, **kwargs):
        super().__init__(**kwargs)
        self.fault, self.flood_words, self.seed_ = fault, flood_words, 0

    def reset(self, *, seed=None, options=None):
        self.seed_ = seed or 0
        return super().reset(seed=seed, options=options)

    def _after_action(self) -> Reply:
        if self.fault == "die" and self._turn == 2 and self.seed_ % 2 == 1:
            raise SandboxDied("the sandbox's container exited (137) and cannot restart")
        if self.fault == "flood":
            output = " ".join(["output"] * (self.flood_words * self._turn))
            return Reply(({"role": "user", "content": f"[log]\n{output}"},))
        return Reply(())

    def _is_correct(self, answer: float) -> bool:
        return self.fault != "never" and super()._is_correct(answer)


gym.register("clawgym-test/Faulty-v0", entry_point=FaultyArith)
