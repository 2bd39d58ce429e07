"""The one list of clawgym's registered environments. Variants are kwargs, not classes."""

from __future__ import annotations

from typing import Any

import gymnasium as gym

NAMESPACE = "clawgym"

# id -> (entry point, default kwargs)
ENVIRONMENTS: dict[str, tuple[str, dict[str, Any]]] = {
    f"{NAMESPACE}/Arith-v0": ("envs.arith.env:ArithEnv", {}),
    f"{NAMESPACE}/GUI-v0": ("envs.gui.env:GUIEnv", {}),
    f"{NAMESPACE}/Chat-v0": ("envs.chat.env:ChatEnv", {}),
    f"{NAMESPACE}/Terminal-v0": ("envs.terminal.env:TerminalEnv", {}),
    f"{NAMESPACE}/ToolCall-v0": ("envs.toolcall.env:ToolCallEnv", {}),
    f"{NAMESPACE}/SWE-v0": ("envs.swe.env:SWEEnv", {}),
    f"{NAMESPACE}/OpenEnv-v0": ("envs.openenv.env:OpenEnvEnv", {}),
}


def register_all() -> None:
    """Registers every clawgym env id with Gymnasium; safe to call more than once."""
    for env_id, (entry_point, kwargs) in ENVIRONMENTS.items():
        if env_id not in gym.registry:
            gym.register(env_id, entry_point=entry_point, kwargs=kwargs)


def registered_ids() -> list[str]:
    """Every clawgym env id known to Gymnasium, including ones registered by plugins."""
    return sorted(env_id for env_id in gym.registry if env_id.startswith(f"{NAMESPACE}/"))
