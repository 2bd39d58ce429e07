import gymnasium as gym
import pytest

import envs  # noqa: F401
from envs.chat.env import CHATTY_REPLY, ChatEnv, ChatReferenceAgent, ChattyAgent
from envs.chat.personas import PERSONAS, on_topic, topic
from envs.chat.tasks import SPLITS, TASKS_PER_PERSONA, load_questions, load_tasks
from envs.chat.user import Verdict
from envs.core import ERROR_PREFIX, IdleAgent

# What OpenClaw-RL's judge reads as progress (+1) and as a correction / redo (-1).
SATISFACTION = ("thank", "perfect", "great", "helpful", "got it", "works for me", "all set")
CORRECTION = (
    "too long",
    "too casual",
    "more than i need",
    "not english",
    "i asked",
    "try again",
    "redo",
    "once more",
    "forgot",
    "not what",
    "not how",
    "didn't",
    "where's",
    "not an answer",
    "forget it",
    "never mind",
    "please",
    "not quite",
    "still not",
)


def play(env, agent, task_id, seed=0):
    """Plays one episode; returns the per-step infos and user messages."""
    observation, info = env.reset(seed=seed, options={"task_id": task_id})
    infos, said = [], []
    terminated = truncated = False
    while not (terminated or truncated):
        observation, reward, terminated, truncated, info = env.step(agent.act(observation, info))
        assert reward == 0.0  # the preference score is never a reward
        infos.append(info)
        said.append(observation[0]["content"])
    # The user's questions are theirs to word ("write a thank-you note"): only the rest is
    # the user's reaction.
    for question in env.task.questions:
        said = [text.replace(question, "<question>") for text in said]
    return infos, said, terminated


def is_satisfied(text):
    lowered = text.lower()
    return any(m in lowered for m in SATISFACTION) and not any(m in lowered for m in CORRECTION)


def is_correction(text):
    lowered = text.lower()
    return any(m in lowered for m in CORRECTION) and not any(m in lowered for m in SATISFACTION)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("persona", sorted(PERSONAS))
def test_reference_agent_meets_the_preference_and_the_user_moves_on(persona, split):
    env = ChatEnv(split=split, persona=persona)
    agent = ChatReferenceAgent(env)
    for index, task_id in enumerate(env.task_ids()[:10]):
        infos, said, terminated = play(env, agent, task_id, seed=index)
        assert terminated and len(infos) == len(env.task.questions) == 3
        assert [i["preference_score"] for i in infos] == [1.0, 1.0, 1.0]
        assert infos[-1]["first_reply_score"] == 1.0
        assert {i["user_verdict"] for i in infos} == {"satisfied"}
        assert all(is_satisfied(text) for text in said), said
        assert said[0].count("<question>") == said[1].count("<question>") == 1


@pytest.mark.parametrize("persona", sorted(PERSONAS))
def test_chatty_agent_scores_zero_and_is_corrected(persona):
    env = ChatEnv(split="test", persona=persona)
    for index, task_id in enumerate(env.task_ids()[:5]):
        infos, said, terminated = play(env, ChattyAgent(), task_id, seed=index)
        assert terminated and len(infos) == 9  # patience 2: three tries at each question
        assert {i["preference_score"] for i in infos} == {0.0}
        assert infos[-1]["first_reply_score"] == 0.0
        assert [i["user_verdict"] for i in infos[:3]] == ["correction", "correction", "gave_up"]
        assert all(is_correction(text) for text in said), said


def test_idle_agent_scores_zero_and_is_asked_again():
    env = ChatEnv(split="test")
    for index, task_id in enumerate(env.task_ids()[::10]):
        infos, said, _ = play(env, IdleAgent(), task_id, seed=index)
        assert {i["preference_score"] for i in infos} == {0.0}
        assert {i["user_verdict"] for i in infos} == {"redo", "gave_up"}
        assert all(is_correction(text) for text in said), said
        assert "<question>" in said[0]  # the question, asked again


def test_every_scripted_phrasing_carries_its_signal():
    env = ChatEnv(persona=None)
    seen: dict[str, set[str]] = {
        "satisfied": set(),
        "corrective": {c for p in PERSONAS.values() for c in p.complaints},
    }
    for seed in range(60):
        env.reset(seed=seed)
        user = env._user
        question = "<question>"
        for attempt in (1, 2):
            seen["corrective"].add(user.react(Verdict.CORRECTION, question, None, attempt))
        seen["corrective"].add(user.react(Verdict.REDO, question, None, 1))
        seen["corrective"].add(user.react(Verdict.GAVE_UP, question, question, 3))
        seen["corrective"].add(user.react(Verdict.GAVE_UP, question, None, 3))
        seen["satisfied"].add(user.react(Verdict.SATISFIED, question, question, 1))
        seen["satisfied"].add(user.react(Verdict.SATISFIED, question, None, 1))
    assert len(seen["satisfied"]) > 20 and len(seen["corrective"]) > 40  # varied phrasing
    assert all(is_satisfied(text) for text in seen["satisfied"])
    assert all(is_correction(text) for text in seen["corrective"])


def test_a_correction_then_a_good_reply_satisfies_and_moves_on():
    env = ChatEnv(persona="brief")
    observation, info = env.reset(seed=5)
    assert info["tools"] == [] and info["preference_score"] is None
    _, _, _, _, info = env.step(CHATTY_REPLY)
    assert (info["user_verdict"], info["attempt"], info["question_index"]) == ("correction", 1, 0)
    assert env.task.questions[0] == "Can you compare a bus and a tram for me?"
    observation, _, terminated, _, info = env.step("A tram runs on rails; a bus on roads.")
    assert (info["user_verdict"], info["attempt"], info["question_index"]) == ("satisfied", 2, 1)
    assert info["first_reply_score"] == 0.0 and not terminated
    assert env.task.questions[1] in observation[0]["content"]


@pytest.mark.parametrize("persona", ["brief", "bullets", "signoff", "formal", "tldr"])
def test_a_reply_about_nothing_that_meets_the_preference_is_asked_again(persona):
    """The user is not pleased by a reply that says nothing: SmolLM2 trained on `brief`
    learned to answer "Awesome." to every question, and the user thanked it."""
    env = ChatEnv(persona=persona)
    env.reset(seed=5)
    asked = env.task.questions[0]  # a bus and a tram
    empty_of_topic = PERSONAS[persona].exemplar("What is a blockchain?")
    assert PERSONAS[persona].satisfied_by(empty_of_topic) and not on_topic(empty_of_topic, asked)
    observation, _, _, _, info = env.step(empty_of_topic)
    assert (info["user_verdict"], info["question_index"], info["preference_score"]) == (
        "redo",
        0,
        1.0,
    )
    assert asked in observation[0]["content"] and info["first_reply_on_topic"] is False
    _, _, _, _, info = env.step(PERSONAS[persona].exemplar(asked))
    assert (info["user_verdict"], info["attempt"], info["question_index"]) == ("satisfied", 2, 1)


def test_spanish_is_not_held_to_english_topic_words():
    env = ChatEnv(persona="spanish")
    env.reset(seed=5)
    _, _, _, _, info = env.step(PERSONAS["spanish"].exemplar(""))
    assert info["user_verdict"] == "satisfied"


@pytest.mark.parametrize(
    ("question", "expected"),
    [
        ("How does the immune system work?", "immune system"),
        ("Can you compare a bus and a tram for me?", "tram"),
        ("What is GPS?", "this"),
    ],
)
def test_topic_names_the_longest_topic_words_in_order(question, expected):
    assert topic(question) == expected


def test_a_question_with_no_topic_word_takes_any_reply_as_on_topic():
    assert on_topic("Use the app.", "What is GPS?")
    assert not on_topic("Awesome.", "How does the immune system work?")
    assert on_topic("Your immune cells fight germs.", "How does the immune system work?")


def test_a_tool_call_is_an_error_and_is_not_scored():
    env = ChatEnv()
    env.reset(seed=0)
    call = {"id": "c", "type": "function", "function": {"name": "search", "arguments": "{}"}}
    observation, reward, _, _, info = env.step({"role": "assistant", "tool_calls": [call]})
    assert observation[0]["content"].startswith(ERROR_PREFIX)
    assert (reward, info["preference_score"], info["user_verdict"]) == (0.0, None, None)


@pytest.mark.parametrize(
    ("persona", "reply", "score"),
    [
        ("brief", " ".join(["word"] * 25), 1.0),
        ("brief", " ".join(["word"] * 50), 0.5),
        ("brief", " ".join(["word"] * 80), 0.0),
        ("bullets", "- one\n- two", 1.0),
        ("bullets", "Here you go:\n- one\n* two\n\u2022 three", 0.75),
        ("bullets", "1. one\n2. two", 0.0),
        ("bullets", "- only one", 0.0),
        ("signoff", "Boil it for nine minutes.\nCheers, Claw", 1.0),
        ("signoff", "Cheers, Claw! Boil it for nine minutes.", 0.5),
        ("signoff", "Cheers, Claw", 0.0),
        ("formal", "Certainly. Boil the egg for nine minutes.", 1.0),
        ("formal", "Boil it for nine minutes. Don't overdo it.", 2 / 3),
        ("formal", "Hey! It's easy, you'll see \U0001f600", 0.0),
        ("spanish", "Hierve el huevo durante nueve minutos y luego ponlo en agua fría.", 1.0),
        ("spanish", "Boil the egg for nine minutes, then put it in cold water.", 0.0),
        ("spanish", "Hierve el huevo. Then put it in the water.", 0.2),
        ("tldr", "TL;DR: nine minutes.\n\nStart with cold water.", 1.0),
        ("tldr", "**TLDR** - nine minutes", 1.0),
        ("tldr", "Start with cold water.\nTL;DR: nine minutes.", 0.5),
        ("tldr", "Boil it for nine minutes.", 0.0),
    ],
)
def test_preference_checks_on_hand_written_replies(persona, reply, score):
    assert PERSONAS[persona].score(reply) == pytest.approx(score)
    assert PERSONAS[persona].score("  \n") == 0.0


def test_splits_are_disjoint_by_subject_and_tasks_stay_in_their_split():
    train, test = load_questions("train"), load_questions("test")
    assert len(train) + len(test) >= 500 and len(test) >= 80
    assert not {q.text for q in train} & {q.text for q in test}
    assert not {(q.family, q.subject) for q in train} & {(q.family, q.subject) for q in test}
    for split, pool in (("train", train), ("test", test)):
        tasks = load_tasks(split)
        assert len(tasks) == TASKS_PER_PERSONA[split] * len(PERSONAS)
        texts = {q.text for q in pool}
        assert all(set(t.questions) <= texts and len(set(t.questions)) == 3 for t in tasks.values())


def test_same_seed_same_conversation_and_seeds_vary_the_wording():
    def transcript(seed):
        env = ChatEnv(split="test")
        observation, info = env.reset(seed=seed)
        said = [observation[-1]["content"], info["task_id"]]
        for reply in (CHATTY_REPLY, PERSONAS[info["persona"]].exemplar(""), "", ""):
            observation, _, terminated, truncated, step_info = env.step(reply)
            said += [observation[0]["content"], step_info]
            if terminated or truncated:
                break
        return said

    assert transcript(7) == transcript(7)
    assert len({str(transcript(seed)) for seed in range(6)}) == 6
    assert (
        load_tasks("test")["chat/test/formal/0003"] == load_tasks("test")["chat/test/formal/0003"]
    )


def test_user_model_rephrases_the_users_words_but_not_the_decisions():
    calls = []

    def user_model(messages):
        calls.append(messages)
        return "LLM USER: " + messages[0]["content"][-30:] if len(calls) == 1 else "  "

    env = ChatEnv(persona="formal", user_model=user_model)
    env.reset(seed=1)
    observation, _, _, _, info = env.step(CHATTY_REPLY)
    assert (
        observation[0]["content"].startswith("LLM USER: ") and info["user_verdict"] == "correction"
    )
    system, *conversation = calls[0]
    assert system["role"] == "system" and "Dr. Novak" in system["content"]
    assert [m["role"] for m in conversation] == ["assistant", "user"]  # roles swapped
    assert conversation[1]["content"] == CHATTY_REPLY
    observation, *_ = env.step(CHATTY_REPLY)
    assert "formal" in observation[0]["content"]  # a blank rephrasing keeps the script


def test_variants_persona_questions_patience_budget_and_revealed_preferences():
    env = gym.make(
        "clawgym/Chat-v0",
        split="test",
        persona="tldr",
        questions_per_episode=2,
        patience=0,
        reveal_preferences=True,
    ).unwrapped
    observation, info = env.reset(seed=0)
    assert info["persona"] == "tldr" and all("/tldr/" in t for t in env.task_ids())
    assert "TL;DR" in observation[0]["content"] and env.max_turns == 2
    _, _, terminated, _, info = env.step(CHATTY_REPLY)
    assert info["user_verdict"] == "gave_up" and info["question_index"] == 1 and not terminated
    _, _, terminated, truncated, _ = env.step(CHATTY_REPLY)
    assert terminated and not truncated
    short = ChatEnv(max_turns=2)
    short.reset(seed=0)
    short.step(CHATTY_REPLY)
    assert short.step(CHATTY_REPLY)[3]  # truncated by the turn budget
    with pytest.raises(ValueError, match="unknown persona"):
        ChatEnv(persona="pirate")
    with pytest.raises(ValueError, match="unknown split"):
        ChatEnv(split="validation")


@pytest.mark.parametrize(
    ("reply", "question", "expected"),
    [
        ("Check the service history of any used car first.", "Tips for buying a used car?", True),
        ("It stores passwords, encrypted.", "How does a password manager work?", True),
        (
            "You are a helpful personal assistant. You are chatting with Sam.",
            "Give me some tips for buying a used car.",
            False,
        ),
        ("The night is a night of the night.", "Can you suggest a quick weeknight dinner?", False),
        ("Pasta with garlic: a quick dinner.", "Can you suggest a quick weeknight dinner?", True),
        ("", "What is a frog?", False),
    ],
)
def test_a_reply_is_on_topic_when_it_shares_a_topic_word(reply, question, expected):
    from envs.chat.personas import on_topic

    assert on_topic(reply, question) is expected


def test_the_first_reply_is_marked_on_or_off_topic():
    env = gym.make("clawgym/Chat-v0", split="test", persona="brief", questions_per_episode=1)
    observation, _ = env.reset(seed=0)
    question = env.unwrapped.task.questions[0]
    _, _, _, _, info = env.step(f"Sure: {question}")
    assert info["first_reply_on_topic"] is True
    env.reset(seed=0)
    _, _, _, _, info = env.step("You are a helpful personal assistant.")
    assert info["first_reply_on_topic"] is False
    assert info["first_reply_score"] == 1.0  # brief, so the preference alone is met
    env.close()
