"""The agent loop: a policy plays one episode of an environment, every turn stored.

The loop records each assistant reply as a `Turn` (token-exact, committed before the
environment sees the action), then fills its next state and reward from the env's step.
It talks to the policy through the engine interface; the serving issue puts the
OpenAI-compatible proxy between them without changing what is stored.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

import gymnasium as gym

from agents.engines.base import Engine, SamplingParams
from agents.store import Store
from agents.trajectory import Session, SessionStatus, Turn, TurnType

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpisodeSummary:
    """What one stored episode came to."""

    session_id: str
    task_id: str
    total_reward: float
    turns: int
    prompt_tokens: int
    completion_tokens: int
    terminated: bool


def run_episode(
    env: gym.Env[Any, Any],
    engine: Engine,
    store: Store,
    *,
    env_id: str,
    task_id: str | None = None,
    seed: int | None = None,
    group_id: str | None = None,
    sampling: SamplingParams | None = None,
) -> EpisodeSummary:
    """Plays one episode with the engine's policy and stores it as a session."""
    observation, info = env.reset(seed=seed, options={"task_id": task_id} if task_id else None)
    session_id = uuid.uuid4().hex
    store.add_session(Session(session_id, env_id, task_id=info["task_id"], group_id=group_id))
    messages: list[dict[str, Any]] = list(observation)
    total = 0.0
    prompt_tokens = completion_tokens = 0
    index = 0
    terminated = truncated = False
    try:
        while not (terminated or truncated):
            completion = engine.generate(messages, info["tools"], sampling)
            store.add_turn(
                Turn(
                    session_id=session_id,
                    index=index,
                    turn_type=TurnType.MAIN,
                    prompt_messages=tuple(messages),
                    prompt_token_ids=completion.prompt_token_ids,
                    completion_token_ids=completion.completion_token_ids,
                    completion_logprobs=completion.completion_logprobs,
                    completion=completion.message,
                    policy_version=completion.policy_version,
                    tools=tuple(info["tools"]),
                )
            )
            observation, reward, terminated, truncated, _ = env.step(dict(completion.message))
            store.set_next_state(session_id, index, observation, env_reward=float(reward))
            messages += [dict(completion.message), *observation]
            total += float(reward)
            prompt_tokens += len(completion.prompt_token_ids)
            completion_tokens += len(completion.completion_token_ids)
            index += 1
    except BaseException:
        store.finish_session(session_id, total, SessionStatus.FAILED)
        raise
    store.finish_session(session_id, total)
    logger.info(
        "episode %s on %s: reward %.2f in %d turns", session_id, info["task_id"], total, index
    )
    return EpisodeSummary(
        session_id, info["task_id"], total, index, prompt_tokens, completion_tokens, terminated
    )
