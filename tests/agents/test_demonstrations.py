"""Demonstrations: reference agents' episodes stored as the policy's own tokens, and the
parquet export that carries them (or any store's turns) to another run."""

import json

import gymnasium as gym
import pytest

import envs  # noqa: F401  (registers the clawgym/ environments)
from agents import export, models
from agents.demonstrations import (
    DEMONSTRATION,
    NoReferenceAgent,
    completion_token_ids,
    import_parquet,
    record_demonstrations,
)
from agents.store import Store
from agents.toolcalls import parse_tool_calls
from agents.trajectory import SessionStatus
from envs.arith.env import ArithEnv
from envs.core import tool_calls_message

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluates an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
HISTORY = [{"role": "user", "content": "What is 6 times 7?"}]


def no_score(prompt_ids, completion_ids, images):
    """Log-probs of zero: these tests are about what is recorded, not how it scores."""
    return [0.0] * len(completion_ids)


@pytest.fixture(scope="module")
def tokenizer():
    return models.load_tokenizer("tiny")


def record_arith(store, tokenizer, episodes):
    return record_demonstrations(
        lambda: gym.make("clawgym/Arith-v0", split="train"),
        "arith",
        store,
        tokenizer,
        episodes=episodes,
        score=no_score,
    )


@pytest.mark.parametrize(
    "reply",
    [
        tool_calls_message([("calculator", {"expression": "6 * 7"})]),
        {"role": "assistant", "content": "It is 42."},
        {
            "role": "assistant",
            "content": "Let me compute.",
            "tool_calls": tool_calls_message([("calculator", {"expression": "6*7"})])["tool_calls"],
        },
    ],
    ids=["tool call", "text", "text and tool call"],
)
def test_a_reply_becomes_the_tokens_that_follow_its_prompt_in_the_whole_conversation(
    tokenizer, reply
):
    prompt = tokenizer.apply_chat_template(
        HISTORY, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    completion = completion_token_ids(tokenizer, HISTORY, TOOLS, reply)
    whole = tokenizer.apply_chat_template(
        [*HISTORY, reply], tools=TOOLS, tokenize=True, return_dict=True
    )["input_ids"]
    # token-exact: the conversation with the reply is the prompt, then these tokens
    assert list(whole[: len(prompt) + len(completion)]) == list(prompt) + completion
    assert completion[-1] == tokenizer.eos_token_id  # the turn ends as the engines stop
    parsed = parse_tool_calls(tokenizer.decode(completion[:-1]))
    assert parsed["content"] == reply["content"]
    calls = [c["function"] for c in reply.get("tool_calls") or []]
    parsed_calls = [c["function"] for c in parsed.get("tool_calls") or []]
    assert [(c["name"], json.loads(c["arguments"])) for c in parsed_calls] == [
        (c["name"], json.loads(c["arguments"])) for c in calls
    ]


def test_reference_demonstrations_of_arith_are_stored_as_solved_sessions(tmp_path, tokenizer):
    with Store(tmp_path / "store.sqlite") as store:
        summaries = record_arith(store, tokenizer, episodes=3)
        assert [s.total_reward for s in summaries] == [1.0, 1.0, 1.0]
        assert len({s.task_id for s in summaries}) == 3  # different tasks
        for summary in summaries:
            session = store.session(summary.session_id)
            assert session.env_id == "arith" and session.status == SessionStatus.DONE
            assert session.metadata[DEMONSTRATION] == "ArithReferenceAgent"
            calculator, submit = session.turns
            assert calculator.completion["tool_calls"][0]["function"]["name"] == "calculator"
            assert submit.completion["tool_calls"][0]["function"]["name"] == "submit"
            # the calculator's answer is what the next turn saw, and what it submitted
            assert calculator.next_state[0]["role"] == "tool"
            assert submit.prompt_messages[-1] == calculator.next_state[0]
            for turn in session.turns:
                text = tokenizer.decode(turn.completion_token_ids, skip_special_tokens=False)
                assert text.endswith(tokenizer.eos_token)
                assert turn.prompt_token_ids == tuple(
                    tokenizer.apply_chat_template(
                        [dict(m) for m in turn.prompt_messages],
                        tools=[dict(t) for t in turn.tools],
                        add_generation_prompt=True,
                        tokenize=True,
                        return_dict=True,
                    )["input_ids"]
                )
            assert submit.env_reward == 1.0


def test_an_env_without_a_reference_agent_cannot_demonstrate(tmp_path, tokenizer):
    with (
        Store(tmp_path / "store.sqlite") as store,
        pytest.raises(NoReferenceAgent, match="parquet export"),
    ):
        record_demonstrations(
            lambda: gym.make("clawgym/Chat-v0", split="train"),
            "chat",
            store,
            tokenizer,
            episodes=1,
            score=no_score,
        )


def test_the_export_command_and_the_import_carry_every_turn_token_exactly(tmp_path, tokenizer):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with Store(run_dir / "store.sqlite") as store:
        record_arith(store, tokenizer, episodes=2)
        originals = store.turns()
    assert export.main([str(run_dir)]) == 0
    assert export.main([str(tmp_path / "missing")]) == 2
    with Store(tmp_path / "other.sqlite") as other:
        assert import_parquet(other, run_dir / "turns.parquet") == len(originals)
        assert import_parquet(other, run_dir / "turns.parquet") == 0  # once only
        copies = other.turns()
        assert [t for _, t in copies] == [t for _, t in originals]
        sessions = other.sessions()
        assert all(s.metadata[DEMONSTRATION].startswith("parquet:") for s in sessions)
        assert [s.outcome_reward for s in sessions] == [1.0, 1.0]


class _Blindfolded(ArithEnv):
    """Arith configured so that its reference agent cannot play any task (as GUI-v0's
    has none for the tasks no solver is written for)."""

    def reference_agent(self):
        return None


def test_an_env_whose_reference_agent_plays_no_task_cannot_demonstrate(tmp_path, tokenizer):
    with (
        Store(tmp_path / "store.sqlite") as store,
        pytest.raises(NoReferenceAgent, match="no reference agent for any of the 2 tasks"),
    ):
        record_demonstrations(_Blindfolded, "blind", store, tokenizer, episodes=2, score=no_score)
    with Store(tmp_path / "store.sqlite") as store:
        assert store.sessions() == []


class _Stumbling(ArithEnv):
    """Arith whose reference agent raises on every other task (a solver that misreads a
    page, or needs an action its agent cannot take)."""

    def reference_agent(self):
        agent = super().reference_agent()
        if int(self.task.task_id.rsplit("/", 1)[-1]) % 2:
            agent.act = lambda observation, info: {}["no such element"]
        return agent


def test_a_reference_agent_that_raises_fails_its_demonstration_not_the_others(tmp_path, tokenizer):
    with Store(tmp_path / "store.sqlite") as store:
        summaries = record_demonstrations(
            _Stumbling, "stumbling", store, tokenizer, episodes=6, score=no_score
        )
        sessions = {s.session_id: s for s in store.sessions()}
    failed = [s for s in summaries if s.status == SessionStatus.FAILED]
    solved = [s for s in summaries if s.total_reward == 1.0]
    assert failed and solved and len(failed) + len(solved) == 6
    for summary in failed:
        assert "the reference agent could not act: KeyError" in summary.error
        assert sessions[summary.session_id].status == SessionStatus.FAILED
