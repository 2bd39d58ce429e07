import pytest

from envs.arith.env import ArithEnv, ArithReferenceAgent
from envs.arith.tasks import SPLIT_SIZES, evaluate, load_tasks
from envs.core import IdleAgent, run_episode


@pytest.mark.parametrize("split", sorted(SPLIT_SIZES))
def test_reference_agent_solves_every_task_and_idle_agent_none(split):
    env = ArithEnv(split=split)
    reference, idle = ArithReferenceAgent(env), IdleAgent()
    ids = env.task_ids()
    assert len(ids) == SPLIT_SIZES[split]
    assert all(run_episode(env, reference, task_id=t).total_reward == 1.0 for t in ids)
    assert all(run_episode(env, idle, task_id=t).total_reward == 0.0 for t in ids[:50])


def test_splits_share_no_problem_and_are_stable():
    train = {t.question for t in load_tasks("train").values()}
    test = {t.question for t in load_tasks("test").values()}
    assert not train & test
    assert load_tasks("train")["arith/train/0003"].question == (
        "Ben reads 17 pages a day for 5 weeks. How many pages is that?"
    )


def test_wrong_answer_ends_the_episode_without_reward():
    env = ArithEnv()
    env.reset(options={"task_id": "arith/train/0000"})
    wrong = env.task.answer + 1
    _, reward, terminated, _, _ = env.step(f"I think so. Answer: {wrong}")
    assert (reward, terminated) == (0.0, True)


def test_text_answer_counts_for_policies_without_tool_calls():
    env = ArithEnv()
    env.reset(options={"task_id": "arith/train/0003"})
    observation, reward, terminated, _, _ = env.step("17 * 35 = 595. Answer: 595")
    assert (observation[0]["content"], reward, terminated) == ("correct", 1.0, True)


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2 + 3 * 4", 14.0),
        ("(2 + 3) * 4", 20.0),
        ("7 / 2", 3.5),
        ("-2 ** 2", -4.0),
        ("7 // 2 % 3", 0.0),
    ],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "fragment"),
    [
        ("__import__('os')", "unsupported"),
        ("1 / 0", "division by zero"),
        ("9 ** 999", "too large"),
        ("2 +", "parse"),
    ],
)
def test_calculator_refuses_what_is_not_arithmetic(expression, fragment):
    with pytest.raises(ValueError, match=fragment):
        evaluate(expression)
    assert ArithEnv().calculator(expression).startswith("[error]")


@pytest.mark.parametrize(
    "reply",
    [
        "Answer: 595",
        "So the answer is 595.",
        "17*35\n#### 595",
        "\\boxed{595}",
        "The answer is: $595",
    ],
)
def test_final_answer_conventions_are_recognised(reply):
    env = ArithEnv()
    env.reset(options={"task_id": "arith/train/0003"})
    assert env.step(reply)[1] == 1.0
