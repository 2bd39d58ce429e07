"""`clawgym/OpenEnv-v0`: a Gymnasium env that plays an environment served over OpenEnv.

`gym.make("clawgym/OpenEnv-v0", base_url="http://host:8010", api_key=...)` opens one
OpenEnv WebSocket session (one env instance on the server) and relays `reset` and `step`
through it, so clawgym's agents and trainers play envs served elsewhere: by
`python -m envs.openenv serve`, or by any OpenEnv server speaking the same chat messages
(`envs.openenv.protocol`). The remote env runs the whole contract (tools, turn budget,
grading), so this class is a plain `gymnasium.Env` that relays `reset` and `step`, not an
`AgentEnv`: it has none of the hooks an env that runs its own tasks implements. Its spaces
are `AgentEnv`'s (messages in, an assistant message out, the tools the server listed). A
step the server cannot answer (the connection dropped, the server errored) ends the
episode, truncated, with an error observation and `info["aborted"]`, as `AgentEnv` does for
a tool that raises. It has no reference agent (no `reference_agent`): the answer key stays
on the server.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import gymnasium as gym

from envs.core import Action, AssistantActionSpace, Message, MessagesSpace, error_message
from envs.openenv.protocol import ChatAction, ChatEnvClient

logger = logging.getLogger(__name__)


class OpenEnvEnv(gym.Env[list[Message], Action]):
    """A remote env, played over OpenEnv.

    Args:
        base_url: the OpenEnv server, e.g. "http://127.0.0.1:8010".
        api_key: the server's key (sent as a bearer token), or None.
        timeout: seconds one reset or step may take on the server.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0):
        self.observation_space = MessagesSpace()
        self.action_space = AssistantActionSpace()
        self.task_id: str | None = None
        self._turn, self._finished = 0, True
        self.base_url = base_url
        self._client = ChatEnvClient(base_url, api_key=api_key, message_timeout_s=timeout).sync()
        self._connected = False

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        super().reset(seed=seed)  # the np_random; the server picks the task
        data: dict[str, Any] = {"seed": seed} if seed is not None else {}
        if options:
            data["options"] = options
        self._connected = True
        observation = self._client.reset(**data).observation
        info = observation.info
        self.task_id = info.get("task_id")
        names = [tool["function"]["name"] for tool in info.get("tools", [])]
        self.action_space = AssistantActionSpace(names)
        self._turn, self._finished = 0, False
        return observation.messages, info

    def step(self, action: Action) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        if self._finished:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        self._turn += 1
        try:
            result = self._client.step(ChatAction(message=copy.deepcopy(action)))
        except Exception as error:  # a bad episode is data: the run that meets one goes on
            logger.warning("episode of %s on %s cut off: %s", self.task_id, self.base_url, error)
            self._client.disconnect()  # the next reset opens a fresh session
            self._finished = True
            aborted = f"{type(error).__name__}: {error}"
            info = {"task_id": self.task_id, "turn": self._turn, "aborted": aborted}
            return [error_message(f"the remote env failed ({aborted})")], 0.0, False, True, info
        observation = result.observation
        self._finished = observation.terminated or observation.truncated
        reward = float(result.reward or 0.0)
        return (
            observation.messages,
            reward,
            observation.terminated,
            observation.truncated,
            (observation.info),
        )

    def close(self) -> None:
        """Ends the session (the server closes its env) and stops the client's loop."""
        if self._connected:
            self._connected = False
            self._client.close()
