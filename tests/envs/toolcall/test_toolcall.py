"""Cross-checks of `clawgym/ToolCall-v0` against BFCL's and tau2's own graders.

The default run checks a sample of every set; `-m slow` sweeps every shipped item."""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

from envs.core import ERROR_PREFIX, IdleAgent, run_episode
from envs.registry import register_all
from envs.toolcall import bfcl, taubench
from envs.toolcall.env import ToolCallEnv, ToolCallReferenceAgent
from envs.toolcall.tasks import load_task_set, resolve
from envs.toolcall.user import ModelUser, ScriptedUser

# Ground truths BFCL's own checker rejects whatever the output: a required parameter the
# possible answer leaves out, a parameter the function doc lacks, or a Java list literal
# its converter cannot read back. They are graded (and rejected) like any other item.
UNSATISFIABLE = {
    "simple_python_200",
    "simple_java_22",
    "simple_java_36",
    "simple_java_65",
    "live_simple_106-63-0",
    "live_simple_112-68-0",
    "live_multiple_507-149-4",
    "live_multiple_862-181-3",
    "live_multiple_964-207-0",
}


def _bfcl_verdict(item: dict[str, Any], category: str, decoded: Any) -> bool:
    """BFCL's verdict computed straight from its checker (as its eval_runner does)."""
    from bfcl_eval.utils import is_empty_output, is_function_calling_format_output

    if "relevance" in category:
        has_call = decoded is not None and not is_empty_output(decoded)
        return not has_call if "irrelevance" in category else has_call
    if decoded is None or not is_function_calling_format_output(decoded):
        return False
    return bool(bfcl.ast_checker(item["function"], decoded, item["answer"], category)["valid"])


def _wrong(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 7919
    if isinstance(value, list):
        return [*value, "clawgym-extra"]
    if isinstance(value, dict):
        return {**value, "clawgym_extra": 1}
    return "clawgym wrong value"  # BFCL's Java parsers search inside text: replace it whole


def perturbations(item: dict[str, Any], category: str) -> dict[str, list[tuple[str, dict]]]:
    """Wrong value, missing argument and extra call variants of the reference answer."""
    calls = bfcl.reference_calls(item, category)
    if "irrelevance" in category:
        name = bfcl.tool_name(item["function"][0]["name"]) if item["function"] else "made_up"
        return {"extra_call": [(name, {})]}
    if category == "live_relevance":
        return {"no_call": []}
    out: dict[str, list[tuple[str, dict]]] = {"extra_call": [*calls, calls[0]]}
    name, arguments = calls[0]
    if arguments:
        key = next(iter(arguments))
        out["wrong_value"] = [(name, arguments | {key: _wrong(arguments[key])}), *calls[1:]]
    docs = {bfcl.tool_name(d["name"]): d for d in item["function"]}
    required = [a for a in docs[name]["parameters"].get("required", []) if a in arguments]
    if required:
        missing = {k: v for k, v in arguments.items() if k != required[0]}
        out["missing_argument"] = [(name, missing), *calls[1:]]
    return out


def _as_message(calls: list[tuple[str, dict]]) -> dict[str, Any] | str:
    if not calls:
        return "No function applies."
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in enumerate(calls)
        ],
    }


def _env_reward(env: ToolCallEnv, task_id: str, action: Any) -> float:
    env.reset(options={"task_id": task_id})
    _, reward, terminated, _, _ = env.step(copy.deepcopy(action))
    assert terminated
    return reward


def _cross_check(category: str, every: int) -> dict[str, int]:
    env = ToolCallEnv(tasks=category, split="all")
    counts = {"items": 0, "accepted": 0, "perturbed": 0, "agree": 0, "checks": 0}
    for index, (task_id, task) in enumerate(env.tasks.items()):
        if index % every:
            continue
        item = task.data
        counts["items"] += 1
        truth = bfcl.reference_calls(item, category)
        variants = {"truth": truth, **perturbations(item, category)}
        for kind, calls in variants.items():
            decoded = [{n: copy.deepcopy(a)} for n, a in calls] if calls else None
            if not calls and "relevance" not in category:
                decoded = None
            expected = _bfcl_verdict(item, category, decoded)
            got = _env_reward(env, task_id, _as_message(calls)) == 1.0
            counts["checks"] += 1
            counts["agree"] += got == expected
            assert got == expected, (task_id, kind, calls)
            if kind == "truth":
                counts["accepted"] += got
                assert got or item["id"] in UNSATISFIABLE, (task_id, calls)
            else:
                counts["perturbed"] += 1
                assert not expected, (task_id, kind, calls)
    env.close()
    return counts


@pytest.mark.parametrize("category", bfcl.SINGLE_TURN)
def test_bfcl_single_turn_sample_agrees_with_bfcl_checker(category):
    counts = _cross_check(category, every=25)
    assert counts["items"] > 0 and counts["agree"] == counts["checks"]


@pytest.mark.slow
@pytest.mark.parametrize("category", bfcl.SINGLE_TURN)
def test_bfcl_single_turn_every_item_agrees_with_bfcl_checker(category):
    counts = _cross_check(category, every=1)
    print(category, counts, file=sys.stderr)
    assert counts["items"] == len(bfcl.load_category(category))


def test_bfcl_checker_loads_without_provider_sdks():
    bfcl._ast_checker_module()
    assert "bfcl_eval.constants.model_config" not in sys.modules  # the stand-in is gone
    assert not any(m.split(".")[0] in ("anthropic", "cohere", "mistralai") for m in sys.modules)


def _multi_turn(category: str, every: int) -> tuple[int, int]:
    env = ToolCallEnv(tasks=category, split="all")
    ref, idle = ToolCallReferenceAgent(env), IdleAgent()
    solved = items = 0
    for index, task_id in enumerate(env.tasks):
        if index % every:
            continue
        items += 1
        result = run_episode(env, ref, task_id=task_id)
        assert result.terminated, task_id
        solved += result.total_reward == 1.0
        assert run_episode(env, idle, task_id=task_id).total_reward == 0.0, task_id
    env.close()
    return items, solved


@pytest.mark.parametrize("category", bfcl.MULTI_TURN)
def test_bfcl_multi_turn_ground_truth_solves_and_idle_fails(category):
    items, solved = _multi_turn(category, every=100)
    assert items == solved == 2


@pytest.mark.slow
@pytest.mark.parametrize("category", bfcl.MULTI_TURN)
def test_bfcl_multi_turn_every_item(category):
    items, solved = _multi_turn(category, every=1)
    print(category, items, solved, file=sys.stderr)
    assert items == solved == 200


def test_multi_turn_wrong_state_is_rejected():
    env = ToolCallEnv(tasks="multi_turn_base", split="all")
    task_id = next(iter(env.tasks))
    env.reset(options={"task_id": task_id})
    turns = len(env.task.data["question"])  # type: ignore[union-attr]
    action = _as_message([("mkdir", {"dir_name": "clawgym_wrong"})])
    observation, *_ = env.step(action)
    assert observation[0]["role"] == "tool" and "error" not in observation[0]["content"].lower()
    reward = 0.0
    for _ in range(turns):
        _, reward, terminated, _, info = env.step("Done.")
    assert terminated and reward == 0.0 and not info["grade"]["valid"]
    env.close()


def test_unknown_tool_and_bad_arguments_are_error_observations():
    env = ToolCallEnv(tasks="multi_turn_base", split="all")
    env.reset(options={"task_id": next(iter(env.tasks))})
    calls = [("no_such_tool", {}), ("cd", {"nope": "x"}), ("cd", {}), ("cd", {"folder": 3})]
    observation, reward, terminated, truncated, _ = env.step(_as_message(calls))
    flagged = [m["content"].startswith(ERROR_PREFIX) for m in observation]
    assert flagged == [True, True, True, False]
    # A value of another type runs, as BFCL runs it: the backend's own error comes back.
    assert observation[3]["content"].startswith("Error during execution:")
    assert reward == 0.0 and not terminated and not truncated
    env.close()


def test_multi_turn_values_of_another_type_run_as_bfcl_runs_them():
    # BFCL's doc declares close_ticket's ticket_id an integer, its data and its ground
    # truth (item 173 of every multi-turn category) use "ticket_001": BFCL executes it.
    env = ToolCallEnv(tasks="multi_turn_base", split="all")
    env.reset(options={"task_id": "bfcl/multi_turn_base_173"})
    observation, *_ = env.step(_as_message([("close_ticket", {"ticket_id": "ticket_001"})]))
    assert "closed successfully" in observation[0]["content"]
    env.close()


def test_multi_turn_function_added_later_runs_as_bfcl_runs_it():
    # miss_func item 49's ground truth calls `tail` at turn 1; its doc comes at turn 3.
    env = ToolCallEnv(tasks="multi_turn_miss_func", split="all")
    observation, info = env.reset(options={"task_id": "bfcl/multi_turn_miss_func_49"})
    assert "tail" not in [tool["function"]["name"] for tool in info["tools"]]
    calls = [("cd", {"folder": "temp"}), ("tail", {"file_name": "file3.txt"}), ("nope", {})]
    observation, *_ = env.step(_as_message(calls))
    assert "Lychee" in observation[1]["content"]
    assert observation[2]["content"].startswith(ERROR_PREFIX)
    env.close()


def _tau2(domain: str, every: int) -> dict[str, int]:
    env = ToolCallEnv(tasks=f"tau2_{domain}", split="all", max_turns=60)
    ref, idle = ToolCallReferenceAgent(env), IdleAgent()
    counts = {"tasks": 0, "reference_full": 0, "idle_none": 0, "idle_full_by_tau2": 0}
    for index, task_id in enumerate(env.tasks):
        if index % every:
            continue
        counts["tasks"] += 1
        assert run_episode(env, ref, task_id=task_id).total_reward == 1.0, task_id
        counts["reference_full"] += 1
        idle_reward = run_episode(env, idle, task_id=task_id).total_reward
        # tau2 itself gives full reward to doing nothing when the reference actions change
        # nothing and nothing must be said (e.g. a request the policy refuses).
        task = env.tasks[task_id].data
        changes = _reference_changes_db(domain, task) or taubench.communicate_info(task)
        assert idle_reward == (0.0 if changes else 1.0), task_id
        counts["idle_none" if idle_reward == 0.0 else "idle_full_by_tau2"] += 1
    env.close()
    return counts


def _reference_changes_db(domain: str, task: Any) -> bool:
    session = taubench.Tau2Session(domain, task)
    before = session.environment.get_db_hash()
    for name, arguments in taubench.reference_actions(task):
        session.call(name, arguments)
    return session.environment.get_db_hash() != before


@pytest.mark.parametrize("domain", taubench.DOMAINS)
def test_tau2_reference_actions_earn_full_reward_and_idle_none(domain):
    counts = _tau2(domain, every=50 if domain == "retail" else 25)  # 3 and 2 tasks
    assert counts["tasks"] >= 2 and counts["reference_full"] == counts["tasks"]


@pytest.mark.slow
@pytest.mark.parametrize("domain", taubench.DOMAINS)
def test_tau2_every_task(domain):
    counts = _tau2(domain, every=1)
    print(domain, counts, file=sys.stderr)
    assert counts["tasks"] == len(taubench.load_tasks(domain))


def test_tau2_bad_call_is_error_observation_and_unknown_tool_too():
    env = ToolCallEnv(tasks="tau2_retail", split="test")
    env.reset(seed=0)
    calls = [("get_order_details", {}), ("nope", {}), ("get_order_details", {"order_id": "#X"})]
    observation, *_ = env.step(_as_message(calls))
    assert observation[0]["content"].startswith(ERROR_PREFIX)
    assert observation[1]["content"].startswith(ERROR_PREFIX)
    assert "Error" in observation[2]["content"]  # tau2's own error text for a missing order
    env.close()


class _EchoEngine:
    """Stands in for an engine (a real model cannot act a customer on this CPU in a test):
    answers as a user would, stopping on the agent's second answer."""

    def __init__(self) -> None:
        self.prompts: list[list[dict[str, Any]]] = []

    def generate(self, messages, tools=None, sampling=None, adapter="policy"):
        self.prompts.append(list(messages))
        text = "###STOP###" if len(self.prompts) > 2 else "I want to return an item."

        class _Completion:
            message = {"role": "assistant", "content": text}

        return _Completion()


def test_model_user_speaks_through_the_engine_with_roles_swapped():
    engine = _EchoEngine()
    env = ToolCallEnv(tasks="tau2_retail", split="test", user=ModelUser(engine))
    observation, _ = env.reset(seed=1)
    assert observation[-1] == {"role": "user", "content": "I want to return an item."}
    observation, _, terminated, _, _ = env.step("Which order?")
    assert not terminated and engine.prompts[-1][-1] == {"role": "user", "content": "Which order?"}
    assert "<scenario>" in engine.prompts[-1][0]["content"]
    _, _, terminated, _, info = env.step("Anything else?")
    assert terminated and "grade" in info
    env.close()


def test_splits_are_fixed_and_disjoint():
    for names in ("bfcl_single_turn", "bfcl_multi_turn", "tau2"):
        train, test = load_task_set(names, "train"), load_task_set(names, "test")
        assert train and test and not set(train) & set(test)
        assert len(train) + len(test) == len(load_task_set(names, "all"))
    assert len(load_task_set("tau2_retail", "test")) == 40
    with pytest.raises(ValueError, match="unknown tool-call task set"):
        resolve("bfcl_nothing")


def test_registered_env_passes_check_env():
    register_all()
    env = gym.make("clawgym/ToolCall-v0", tasks="simple_python,tau2_airline")
    check_env(env.unwrapped, skip_render_check=True)
    env.close()


def test_scripted_user_stops_after_its_lines():
    user = ScriptedUser(["first"])
    assert user.opening("why") == "why"
    assert user.reply("why", []) == "first"
    assert user.reply("why", []) == "###STOP###"
