"""`example/GuessNumber-v0`, an environment defined outside clawgym (docs/environments.md).

Importing this module registers the id, so a run names it as
`examples.guess_number:example/GuessNumber-v0` (gymnasium's `module:id`).
"""

import gymnasium as gym

ENV_ID = "example/GuessNumber-v0"

if ENV_ID not in gym.registry:
    gym.register(ENV_ID, entry_point="examples.guess_number.env:GuessNumberEnv")
