"""SmolLM2-135M-Instruct's default replies miss every persona's preference (slow: 5-15 min).

The first reply to five held-out tasks per persona, sampled greedily by the embedded
engine, is scored by the persona's evaluation-only check. The mean per persona is logged
(run with `--log-cli-level=INFO` to read it) and must stay below the persona's threshold:
a preference the base model already meets would leave nothing to learn.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import pytest

from agents.engines.base import SamplingParams
from agents.engines.embedded import EmbeddedEngine
from envs.chat.env import ChatEnv
from envs.chat.personas import PERSONAS

logger = logging.getLogger(__name__)

PROMPTS_PER_PERSONA = 5
MAX_TOKENS = 96
"""Cutting a reply can only raise its brevity and register scores (fewer words, fewer
informalities); language, bullets and TL;DR show from its start. Only the sign-off could
hide past the cut, and the base model never writes 'Cheers, Claw' unprompted."""


def first_prompts(key: str) -> list[list[dict]]:
    env = ChatEnv(split="test", persona=key)
    return [
        env.reset(seed=i, options={"task_id": t})[0]
        for i, t in enumerate(env.task_ids()[:PROMPTS_PER_PERSONA])
    ]


def first_reply_score(engine: EmbeddedEngine, key: str, prompt: list[dict]) -> float:
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    completion = engine.generate(prompt, [], sampling)
    text = str(completion.message.get("content") or "")
    score = PERSONAS[key].score(text)
    logger.info("%s %.2f (%d tokens): %r", key, score, len(completion.completion_token_ids), text)
    return score


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_default_replies_miss_every_preference():
    engine = EmbeddedEngine("smollm2-135m", threads=1)
    jobs = [(key, prompt) for key in PERSONAS for prompt in first_prompts(key)]
    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            scores = list(pool.map(lambda job: first_reply_score(engine, *job), jobs))
    finally:
        engine.close()
    means = {
        key: sum(s for (k, _), s in zip(jobs, scores, strict=True) if k == key)
        / PROMPTS_PER_PERSONA
        for key in PERSONAS
    }
    logger.info("SmolLM2-135M base first-reply preference scores: %s", means)
    assert all(means[key] < PERSONAS[key].threshold for key in PERSONAS), means
    assert sum(means.values()) / len(means) < 0.5, means
