"""clawgym/SWE-v0: the gold test (the gold patch resolves, the empty patch does not, a fix
that breaks a PASS_TO_PASS test does not) on a sample by default and on every shipped
instance under `slow`; the editor tool; the SWE-bench predictions export."""

import json

import pytest

from envs.core import IdleAgent, run_episode
from envs.swe.env import SWEEnv, SWEReferenceAgent, evaluate
from envs.swe.instances import load_instances
from envs.swe.sources import BY_REPO


def call(name, **arguments):
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": function}]}


def gold_check(env, task_ids):
    reference, idle = SWEReferenceAgent(env), IdleAgent()
    for task_id in task_ids:
        assert run_episode(env, reference, task_id=task_id).total_reward == 1.0, task_id
        assert env.report is not None and env.report.resolved
        assert run_episode(env, idle, task_id=task_id).total_reward == -1.0, task_id
        assert env.report is not None and not env.report.resolved and not env.submitted_patch


def sample(ids, count):
    """Instances of different projects, spread over the set."""
    chosen, repos = [], set()
    for task_id in ids[:: max(1, len(ids) // 40)]:
        repo = task_id.rsplit("-", 1)[0]
        if repo not in repos:
            chosen.append(task_id)
            repos.add(repo)
        if len(chosen) == count:
            break
    return chosen


def test_gold_resolves_and_empty_patch_does_not_on_a_sample(backend):
    env = SWEEnv(split="all", sandbox=backend, max_turns=5)
    try:
        gold_check(env, sample(env.task_ids(), 2 if backend == "bwrap" else 1))
    finally:
        env.close()


@pytest.mark.slow
def test_gold_resolves_and_empty_patch_does_not_on_every_shipped_instance(backend):
    env = SWEEnv(split="all", sandbox=backend, max_turns=5)
    try:
        gold_check(env, env.task_ids())
    finally:
        env.close()


def breaking_pair(instances):
    """(a, b) of one project: b's bug breaks one of a's PASS_TO_PASS tests elsewhere."""
    for a in instances:
        for b in instances:
            if a.repo == b.repo and a is not b and set(b.fail_to_pass) & set(a.pass_to_pass):
                if not set(b.fail_to_pass) & set(a.fail_to_pass):
                    return a, b
    raise AssertionError("no instance pair to build a P2P-breaking fix from")


def test_a_fix_that_breaks_a_pass_to_pass_test_is_not_resolved():
    a, b = breaking_pair(load_instances())
    env = SWEEnv(split="all", sandbox="bwrap", max_turns=4)
    try:
        env.reset(options={"task_id": a.instance_id})
        script = (
            f"cd /testbed && git apply <<'__A__'\n{a.patch}__A__\n"
            f"git apply -R <<'__B__'\n{b.patch}__B__"
        )
        observation, *_ = env.step(call("bash", command=script))
        assert observation[0]["content"].endswith("[exit code 0]"), observation
        _, reward, terminated, _, info = env.step(call("submit"))
        assert terminated and reward == -1.0 and info["resolved"] is False
        report = env.report
        assert report is not None and not report.tests_status["FAIL_TO_PASS"]["failure"]
        assert report.tests_status["PASS_TO_PASS"]["failure"]
    finally:
        env.close()


def test_editor_views_edits_and_undoes_and_the_fraction_reward():
    env = SWEEnv(split="all", sandbox="bwrap", max_turns=12, reward="fraction")
    try:
        task_id = env.task_ids()[0]
        env.reset(options={"task_id": task_id})
        # inside the project's package: a new module elsewhere is left out of the patch
        path = f"{BY_REPO[env.instances[task_id].repo].package}/new_module.py"
        steps = [
            call("editor", command="create", path=path, file_text="a = 1\nb = 2\n"),
            call("editor", command="str_replace", path=path, old_str="b = 2", new_str="b = 3"),
            call("editor", command="insert", path=path, insert_line=0, new_str="# top"),
            call("editor", command="view", path=path, view_range=[2, 3]),
            call("editor", command="str_replace", path=path, old_str="= ", new_str="="),
            call("editor", command="undo_edit", path=path),
            call("editor", command="view", path=path),
        ]
        outputs = [env.step(action)[0][0]["content"] for action in steps]
        assert outputs[3] == "     2\ta = 1\n     3\tb = 3"
        assert "occurs 2 times" in outputs[4] and outputs[4].startswith("[error]")
        assert outputs[6] == "     1\ta = 1\n     2\tb = 3"
        _, reward, terminated, _, info = env.step(call("submit"))
        assert terminated and "new_module.py" in info["model_patch"]
        assert 0.0 <= reward < 1.0 and not info["resolved"]
    finally:
        env.close()


def test_predictions_export_in_swe_bench_format(tmp_path):
    env = SWEEnv(split="all", sandbox="bwrap", max_turns=5)
    try:
        ids = env.task_ids()[:1]
        reports = evaluate(env, SWEReferenceAgent(env), ids, "reference", tmp_path)
    finally:
        env.close()
    rows = [json.loads(x) for x in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert [r["instance_id"] for r in rows] == ids and rows[0]["model_patch"].startswith("diff")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["resolved_ids"] == ids and reports[0].resolved
