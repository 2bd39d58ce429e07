import gymnasium as gym
import pytest

import envs  # noqa: F401  (registers the clawgym/ environments)
from agents.engines.base import Completion, SamplingParams
from agents.trajectory import Judgement, Session, SessionStatus
from tests.agents.test_trajectory import make_turn
from trainers.config import JudgeConfig
from trainers.judge import (
    HINT_HEADER,
    EnvJudge,
    LLMJudge,
    build_judge,
    feedback_hint,
    feedback_vote,
    fill,
    majority,
    marked_hint,
    parse_hint,
    parse_vote,
    render_next_state,
    with_hint,
)


@pytest.mark.parametrize(
    ("text", "vote"),
    [
        ("Clearly good. \\boxed{1}", 1),
        ("\\boxed{+1}", 1),
        ("first \\boxed{1} then \\boxed{-1}", -1),  # the last box counts
        ("\\boxed{ 0 }", 0),
        ("\\boxed{2}", None),
        ("score: 1", None),
        ("", None),
    ],
)
def test_vote_is_read_from_the_last_box(text, vote):
    assert parse_vote(text) == vote


@pytest.mark.parametrize(
    ("votes", "score"),
    [
        ([1, 1, -1], 1.0),
        ([-1, -1, 1], -1.0),
        ([1, -1, None], 0.0),  # tie among valid votes
        ([1, -1, 0], 0.0),  # three-way tie
        ([0, 0, 1], 0.0),  # 0 wins the majority
        ([None, None, None], 0.0),  # no valid vote
        ([None, None, -1], -1.0),  # unparsable votes are ignored
        ([], 0.0),
    ],
)
def test_majority_with_ties_and_invalid_votes(votes, score):
    assert majority(votes) == score


def test_hint_needs_a_yes_and_more_than_ten_characters():
    good = "Correction found. [HINT_START] Answer in one short sentence. [HINT_END] \\boxed{1}"
    assert parse_hint(good) == "Answer in one short sentence."
    assert parse_hint(good.replace("\\boxed{1}", "\\boxed{-1}")) is None
    assert parse_hint("[HINT_START]Be brief.[HINT_END] \\boxed{1}") is None  # 9 characters
    assert parse_hint("\\boxed{1} but no markers") is None
    assert marked_hint("[HINT_START] Use  bullet\npoints.[HINT_END] \\boxed{-1}") == (
        "Use bullet points."
    )
    assert marked_hint("no markers") == ""


def test_teacher_context_appends_the_hint_to_the_last_user_message():
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "second"},
        {"role": "tool", "content": "t"},
    ]
    hinted = with_hint(messages, "Be brief.")
    assert hinted[3]["content"] == "second" + HINT_HEADER + "Be brief."
    assert messages[3]["content"] == "second"  # the turn's own messages are untouched
    assert with_hint([{"role": "system", "content": "s"}], "Be brief.")[-1] == {
        "role": "user",
        "content": "[user's hint / instruction]\nBe brief.",
    }


def test_next_state_rendering_names_tool_results():
    assert render_next_state([{"role": "user", "content": "too long"}]) == ("user", "too long")
    role, text = render_next_state(
        [{"role": "tool", "content": "4"}, {"role": "tool", "content": "5"}]
    )
    assert (role, text) == ("environment (tool result)", "4\n5")


class ScriptedVoter:
    """Stands in for a capable judge model, which cannot run on this CPU machine (the
    models that fit here do not follow the judge prompt): it answers each prompt kind
    with fixed texts, in turn. Only the voter is scripted; the teacher is a real model."""

    def __init__(self, score_answers, hint_answers):
        self.answers = {"score": list(score_answers), "hint": list(hint_answers)}

    def generate(self, messages, tools=None, sampling=None, adapter=None):
        kind = "hint" if "[HINT_START]" in messages[-1]["content"] else "score"
        text = self.answers[kind].pop(0)
        message = {"role": "assistant", "content": text}
        return Completion(message, (), (), (), "stop", 0, text)


def judged_turn(tiny_engine):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    completion = tiny_engine.generate(messages, sampling=SamplingParams(max_tokens=16, seed=0))
    return make_turn(
        prompt_messages=tuple(messages),
        prompt_token_ids=completion.prompt_token_ids,
        completion_token_ids=completion.completion_token_ids,
        completion_logprobs=completion.completion_logprobs,
        completion=completion.message,
        next_state=({"role": "user", "content": "Too long. Just the number, please."},),
    )


def test_llm_judge_votes_hints_and_scores_the_teacher_with_the_real_model(tiny_engine):
    turn = judged_turn(tiny_engine)
    voter = ScriptedVoter(
        ["It asks to redo. \\boxed{-1}", "\\boxed{-1}", "unsure"],
        [
            "[HINT_START]Reply with the number only.[HINT_END] \\boxed{1}",
            "\\boxed{-1}",
            "[HINT_START]Short.[HINT_END]\\boxed{1}",
        ],
    )
    judge = LLMJudge(JudgeConfig(votes=3, decoding="free"), voter=voter, teacher=tiny_engine)
    judgement = judge.judge(turn, Session("s", "e"), want_hint=True)
    assert judgement.votes == (-1, -1) and judgement.score == -1.0
    assert judgement.hint == "Reply with the number only."
    assert judgement.hint_candidates == ("Reply with the number only.",)
    hinted = tiny_engine.encode(with_hint(turn.prompt_messages, judgement.hint))
    expected = tiny_engine.score(hinted, turn.completion_token_ids, adapter=None)
    assert judgement.teacher_logprobs == pytest.approx(expected, abs=1e-6)
    assert len(judgement.teacher_logprobs) == len(turn.completion_token_ids)
    assert judgement.teacher_logprobs != pytest.approx(turn.completion_logprobs, abs=1e-4)


def test_turn_without_next_state_waits_while_its_session_is_open(tiny_engine):
    judge = LLMJudge(
        JudgeConfig(votes=1, decoding="free"), voter=ScriptedVoter([], []), teacher=tiny_engine
    )
    turn = make_turn()
    assert judge.judge(turn, Session("s", "e"), want_hint=False) is None
    closed = judge.judge(turn, Session("s", "e", status=SessionStatus.DONE), want_hint=False)
    assert closed.score == 0.0 and closed.votes == () and closed.hint is None


@pytest.mark.parametrize("kind", ["self", "feedback"])
def test_an_empty_next_state_is_final_and_masked_in_an_open_session(tiny_engine, kind):
    """The proxy ends a turn nothing continued with an empty next state: no vote is
    asked (the scripted voter has none to give), the turn is masked."""
    judge = (
        LLMJudge(JudgeConfig(votes=1, decoding="free"), ScriptedVoter([], []), tiny_engine)
        if kind == "self"
        else build_judge(JudgeConfig(kind="feedback"), tiny_engine)
    )
    judgement = judge.judge(make_turn(next_state=()), Session("s", "e"), want_hint=True)
    assert judgement == Judgement()


@pytest.mark.parametrize(("outcome", "score"), [(1.0, 1.0), (0.0, 0.0), (-0.5, -1.0), (None, 0.0)])
def test_env_judge_scores_finished_episodes_by_their_outcome(outcome, score):
    done = Session("s", "e", outcome_reward=outcome, status=SessionStatus.DONE)
    assert EnvJudge().judge(make_turn(), done, want_hint=False).score == score
    assert EnvJudge().judge(make_turn(), Session("s", "e"), want_hint=False) is None


def test_build_judge_by_kind_and_import_path(tiny_engine):
    assert isinstance(build_judge(JudgeConfig(kind="self"), tiny_engine), LLMJudge)
    assert isinstance(build_judge(JudgeConfig(kind="env"), tiny_engine), EnvJudge)
    custom = build_judge(JudgeConfig(kind="tests.trainers.test_judge:ConstantJudge"), tiny_engine)
    assert custom.judge(make_turn(), Session("s", "e"), want_hint=False).score == 1.0
    with pytest.raises(ValueError, match="module:Class"):
        build_judge(JudgeConfig(kind="oracle"), tiny_engine)
    with pytest.raises(ValueError, match="judge.base_url"):
        build_judge(JudgeConfig(kind="remote"), tiny_engine)


class ConstantJudge:
    """A custom judge loaded by import path."""

    def __init__(self, config, engine):
        self.config = config

    def judge(self, turn, session, want_hint):
        from agents.trajectory import Judgement

        return Judgement(votes=(1,), score=1.0)


def test_templates_fill_their_slots_once_and_keep_other_braces():
    from trainers.judge import fill, load_template

    template = "R: {reply} / N ({next_role}): {next_state} -> \\boxed{1}"
    filled = fill(template, {"reply": "says {next_state}", "next_role": "user", "next_state": "ok"})
    assert filled == "R: says {next_state} / N (user): ok -> \\boxed{1}"
    assert "{reply}" in load_template("judge_score")
    assert "[HINT_START]" in load_template("judge_hint")


def test_guided_votes_are_always_valid_and_follow_the_judge_models_probabilities(tiny_engine):
    turn = judged_turn(tiny_engine)
    judge = LLMJudge(
        JudgeConfig(votes=5, decoding="guided"), voter=tiny_engine, teacher=tiny_engine
    )
    judgement = judge.judge(turn, Session("s", "e"), want_hint=False)
    assert len(judgement.votes) == 5 and set(judgement.votes) <= {1, -1, 0}
    # at a near-zero temperature every vote is the option the model finds likeliest
    cold = LLMJudge(
        JudgeConfig(votes=5, decoding="guided", temperature=1e-4),
        voter=tiny_engine,
        teacher=tiny_engine,
    )
    votes = cold.judge(turn, Session("s", "e"), want_hint=False).votes
    role, text = render_next_state(turn.next_state)
    prompt = [
        {
            "role": "user",
            "content": fill(
                judge.score_template,
                {"reply": turn.completion["content"] or "", "next_role": role, "next_state": text},
            ),
        }
    ]
    prompt_ids = tiny_engine.encode(prompt)
    end_of_turn = tiny_engine.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def likelihood(option):
        answer = tiny_engine.tokenizer(f"\\boxed{{{option}}}", add_special_tokens=False)[
            "input_ids"
        ]
        return sum(tiny_engine.score(prompt_ids, [*answer, end_of_turn]))

    assert votes == (max((1, -1, 0), key=likelihood),) * 5


@pytest.mark.parametrize(
    ("text", "vote"),
    [
        ("Thanks, that's what I needed.", 1),
        ("Perfect! Now, how do I boil an egg?", 1),
        ("Thanks, but that is too long.", -1),
        ("Wrong language. Answer in French only.", -1),
        ("Could you please use a table?", -1),
        ("You forgot the summary at the top.", -1),
        ("How do I boil an egg?", 0),
    ],
)
def test_feedback_vote_reads_complaints_before_thanks(text, vote):
    assert feedback_vote(text) == vote


def test_feedback_hint_keeps_the_instructions_and_drops_bare_retries():
    text = "Still not right. Too long. Keep it under 20 words. Try again."
    assert feedback_hint(text) == "Too long. Keep it under 20 words."


def test_feedback_judge_agrees_with_the_simulated_users_verdicts():
    """On real Chat-v0 conversations (every persona, replies that meet or miss the
    preference), the judge's vote has the sign of the user's own verdict."""
    agreed = total = 0
    for persona in ("brief", "bullets", "signoff", "formal", "spanish", "tldr"):
        env = gym.make("clawgym/Chat-v0", persona=persona, questions_per_episode=3)
        for seed in range(4):
            env.reset(seed=seed)
            for step in range(6):
                reply = "Yes." if (seed + step) % 2 else "Sure! " + "Here is a long answer. " * 9
                observation, _, terminated, _, info = env.step(
                    {"role": "assistant", "content": reply}
                )
                want = 1 if info["user_verdict"] == "satisfied" else -1
                if observation:
                    total += 1
                    agreed += feedback_vote(observation[-1]["content"]) == want
                if terminated:
                    break
        env.close()
    assert total > 100
    assert agreed == total


def test_feedback_judge_scores_hints_and_teacher_log_probs(tiny_engine):
    turn = judged_turn(tiny_engine)
    judge = build_judge(JudgeConfig(kind="feedback"), tiny_engine)
    judgement = judge.judge(turn, Session("s", "e"), want_hint=True)
    assert judgement.votes == (-1,) and judgement.score == -1.0
    assert judgement.hint == "Too long. Just the number, please."
    hinted = tiny_engine.encode(with_hint(turn.prompt_messages, judgement.hint))
    expected = tiny_engine.score(hinted, turn.completion_token_ids, adapter=None)
    assert judgement.teacher_logprobs == pytest.approx(expected, abs=1e-6)
    tool_result = turn.replace(next_state=({"role": "tool", "content": "ok"},))
    assert judge.judge(tool_result, Session("s", "e"), want_hint=True).score == 0.0
