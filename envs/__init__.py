"""clawgym environments: Gymnasium envs, task sets, sandboxes, graders, simulated users.

Importing the package registers every `clawgym/<Name>-v0` id with Gymnasium, as Gymnasium's
own packages do; entry points are strings, so no environment module is imported until
`gymnasium.make` builds one.
"""

from envs.registry import register_all

register_all()
