"""Environments that fail on purpose, for the tests of a run that meets bad episodes. They
are registered on import, so a run names them as
`tests.trainers.faulty_envs:clawgym-test/Faulty-v0` (gymnasium's `module:id`), the way a
user's own environment is trained.

They stand in for failures that a real environment cannot be made to show on demand: a
sandbox that dies in a way its env cannot recover from (the bwrap and Docker sandboxes
restart a killed shell), tool output that floods the context, a task no answer solves
(every rollout of a group scores the same, as under a policy that never solves), and an
observation with an image the policy's server does not take.
"""

from __future__ import annotations

import base64
import io
import random

import gymnasium as gym
from PIL import Image

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
            answer is ever right: every episode's outcome is 0) or image (the first
            action's observation carries `image`, a bad image).
        flood_words: words of the first flooding observation.
        image: gif (a GIF data URL), remote (an https URL), large (a 75 KiB PNG) or many
            (eight small PNGs).
    """

    def __init__(self, fault: str = "die", flood_words: int = 100, image: str = "gif", **kwargs):
        super().__init__(**kwargs)
        self.fault, self.flood_words, self.image, self.seed_ = fault, flood_words, image, 0

    def reset(self, *, seed=None, options=None):
        self.seed_ = seed or 0
        return super().reset(seed=seed, options=options)

    def _after_action(self) -> Reply:
        if self.fault == "die" and self._turn == 2 and self.seed_ % 2 == 1:
            raise SandboxDied("the sandbox's container exited (137) and cannot restart")
        if self.fault == "flood":
            output = " ".join(["output"] * (self.flood_words * self._turn))
            return Reply(({"role": "user", "content": f"[log]\n{output}"},))
        if self.fault == "image" and self._turn == 1:
            parts = [{"type": "image_url", "image_url": {"url": u}} for u in BAD_IMAGES[self.image]]
            return Reply(
                ({"role": "user", "content": [{"type": "text", "text": "Look:"}, *parts]},)
            )
        return Reply(())

    def _is_correct(self, answer: float) -> bool:
        return self.fault != "never" and super()._is_correct(answer)


def _png(size: int, noise: bool) -> str:
    """The data URL of a square PNG: of random pixels (incompressible) or of one colour."""
    pixels = random.Random(size).randbytes(size * size * 3) if noise else bytes(size * size * 3)
    buffer = io.BytesIO()
    Image.frombytes("RGB", (size, size), pixels).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


BAD_IMAGES = {
    "gif": ["data:image/gif;base64,R0lGODlhAQABAAAAACw="],
    "remote": ["https://example.com/screen.png"],
    "large": [_png(160, noise=True)],
    "many": [_png(8, noise=False)] * 8,
}
"""Each `image` of the `image` fault: the URLs its observation shows. `large` (75 KiB) is past a
`model.max_image_bytes` of 64 KiB, `many` past a `model.max_images` of 7."""


gym.register("clawgym-test/Faulty-v0", entry_point=FaultyArith)
