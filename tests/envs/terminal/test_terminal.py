"""clawgym/Terminal-v0: task sets, graders, and the gold test (the reference solution
earns full reward, a do-nothing agent none) on a sample by default and on every shipped
task under `slow`."""

import dataclasses
import json
import math

import pytest

from envs.core import IdleAgent, run_episode
from envs.sandbox import SandboxError
from envs.terminal.env import TerminalEnv, TerminalReferenceAgent, load_task_set
from envs.terminal.grading import Run, grade_icalfa, prepare, tfidf_similarity
from envs.terminal.tasks import SHIPPED, load_icalfa, load_tbench


def call(name, arguments):
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": function}]}


def gold_check(env, task_ids):
    reference, idle = TerminalReferenceAgent(env), IdleAgent()
    for task_id in task_ids:
        assert run_episode(env, reference, task_id=task_id).total_reward == 1.0, task_id
        assert run_episode(env, idle, task_id=task_id).total_reward == 0.0, task_id


@pytest.mark.parametrize("tasks", ["tbench", "icalfa"])
def test_gold_on_a_sample(backend, tasks):
    env = TerminalEnv(tasks=tasks, split="all", sandbox=backend, max_turns=3)
    try:
        ids = env.task_ids()
        gold_check(env, [ids[0], ids[len(ids) // 2]] if backend == "bwrap" else [ids[1]])
    finally:
        env.close()


@pytest.mark.slow
@pytest.mark.parametrize("tasks", ["tbench", "icalfa"])
def test_gold_on_every_shipped_task(backend, tasks):
    env = TerminalEnv(tasks=tasks, split="all", sandbox=backend, max_turns=2)
    try:
        gold_check(env, env.task_ids())
    finally:
        env.close()


def test_task_sets_and_held_out_splits():
    assert len(load_icalfa()) == 300 and len(load_tbench(str(SHIPPED))) >= 20
    for source in ("tbench", "icalfa"):
        train, test = load_task_set(source, "train"), load_task_set(source, "test")
        assert train.keys().isdisjoint(test.keys())
        assert len(train) + len(test) == len(load_task_set(source, "all"))
    assert len(load_task_set("icalfa", "test")) == 60
    assert load_icalfa()[3].solution == "cp /testbed/hello.php /testbed/hello-COPY.php"


def test_a_task_directory_in_terminal_bench_format_loads(tmp_path):
    task = tmp_path / "hello"
    (task / "tests").mkdir(parents=True)
    (task / "task.yaml").write_text(
        "instruction: Write hi to /app/hi.txt\nmax_test_timeout_sec: 30\n"
    )
    (task / "solution.yaml").write_text("- command: echo hi > /app/hi.txt\n")
    (task / "tests" / "test_outputs.py").write_text(
        "def test_hi():\n    assert open('/app/hi.txt').read() == 'hi\\n'\n"
    )
    env = TerminalEnv(tasks=str(tmp_path), split="all", sandbox="bwrap", max_turns=2)
    try:
        assert env.task_ids() == ["tbench/hello"]
        gold_check(env, ["tbench/hello"])
    finally:
        env.close()
    (task / "task.yaml").write_text("difficulty: easy\n")
    load_tbench.cache_clear()
    with pytest.raises(ValueError, match="no instruction"):
        load_task_set(str(tmp_path), "all")


def test_shell_state_persists_across_turns_and_timeouts_are_reported():
    env = TerminalEnv(tasks="tbench", sandbox="bwrap")
    try:
        env.reset(options={"task_id": "tbench/count-lines"})
        env.step(call("bash", {"command": "cd /app && export N=5"}))
        observation, *_ = env.step(call("bash", {"command": "pwd; echo $N; ls missing"}))
        content = observation[0]["content"]
        assert content.startswith("/app\n5\n[stderr]") and content.endswith("[exit code 2]")
        env.task = env.task.__class__(**{**env.task.__dict__, "command_timeout": 1.0})
        observation, *_ = env.step(call("bash", {"command": "sleep 30"}))
        assert "killed after 1 s" in observation[0]["content"]
    finally:
        env.close()


def test_a_task_set_up_keeps_the_agents_shell_and_a_failed_set_up_is_an_error(backend):
    # the set-up runs in a child bash: the sandbox's own shell lives on, no new one started
    env = TerminalEnv(tasks="tbench", sandbox=backend)
    try:
        env.reset(options={"task_id": "tbench/count-lines"})
        shell = env.sandbox.exec("echo $$").stdout
        task = dataclasses.replace(env.task, setup="echo ready > /tmp/set-up; exit 0")
        prepare(env.sandbox, task)
        after = env.sandbox.exec("echo $$; cat /tmp/set-up")
        assert (after.stdout, after.stderr, after.shell_restarted) == (f"{shell}ready\n", "", False)
        with pytest.raises(SandboxError, match="setup of tbench/count-lines failed .exit code 3"):
            prepare(env.sandbox, dataclasses.replace(task, kind="harbor", setup="exit 3"))
    finally:
        env.close()


def test_planted_conftest_cannot_fake_a_pass(backend):
    env = TerminalEnv(tasks="tbench", split="all", sandbox=backend, max_turns=4)
    plant = (
        "printf 'def pytest_collection_modifyitems(items):\\n    items.clear()\\n' "
        "> /app/conftest.py; "
        "mkdir -p /tests && cp /app/conftest.py /tests/conftest.py 2>/dev/null; true"
    )
    try:
        env.reset(options={"task_id": "tbench/count-lines"})
        env.step(call("bash", {"command": plant}))
        _, reward, terminated, _, info = env.step(call("submit", {}))
        assert (reward, terminated) == (0.0, True) and info["grade"].startswith("0/2")
    finally:
        env.close()


def test_running_out_of_turns_is_graded_like_a_submit():
    env = TerminalEnv(tasks="tbench", split="all", sandbox="bwrap", max_turns=2)
    try:
        env.reset(options={"task_id": "tbench/count-lines"})
        env.step(call("bash", {"command": "wc -l < /app/data.txt > /app/count.txt"}))
        _, reward, terminated, truncated, info = env.step("thinking...")
        assert (reward, terminated, truncated, info["grade"]) == (
            1.0,
            False,
            True,
            "2/2 tests passed",
        )
    finally:
        env.close()


def test_tfidf_similarity_matches_scikit_learns_definition():
    # idf(hello) = ln(3/3) + 1 = 1, idf(world) = idf(there) = ln(3/2) + 1
    rare = math.log(1.5) + 1
    assert tfidf_similarity("Hello world", "hello there") == pytest.approx(1 / (1 + rare**2))
    assert tfidf_similarity("a b", "c d") == 0.0  # no word of two letters


def test_intercode_reward_parts():
    base = {"/testbed/a.txt": "h1"}
    gold = Run("touch /testbed/b.txt", "", base, {**base, "/testbed/b.txt": "h0"})
    same = Run("> /testbed/b.txt", "", base, {**base, "/testbed/b.txt": "h0"})
    assert grade_icalfa(same, gold).reward == 1.0
    wrong = Run("echo x > /testbed/b.txt", "", base, {**base, "/testbed/b.txt": "h9"})
    verdict = grade_icalfa(wrong, gold)
    assert verdict.details["file_changes"] == 0.0 and verdict.reward == 0.67
    # a file the gold itself writes differently on each run is not held against the agent
    assert grade_icalfa(wrong, gold, frozenset({"/testbed/b.txt"})).reward == 1.0
    nothing = Run("true", "", base, base)
    assert grade_icalfa(nothing, gold).details["diff_missing"] == ["/testbed/b.txt"]
    assert grade_icalfa(None, gold).reward == 0.0


# A plugin that makes every test pass without running it: what a hostile agent would load
# into the grader's pytest by any start-up route.
PASS_EVERYTHING = (
    "import pytest\n"
    "@pytest.hookimpl(hookwrapper=True)\n"
    "def pytest_runtest_call(item):\n"
    "    item.runtest = lambda: None\n"
    "    yield\n"
)


def gamed_reward(backend, plant):
    """The grade of count-lines after the agent runs `plant` and submits without doing it."""
    env = TerminalEnv(tasks="tbench", split="all", sandbox=backend, max_turns=4)
    try:
        env.reset(options={"task_id": "tbench/count-lines"})
        _, _, _, _, _ = env.step(call("bash", {"command": plant}))
        _, reward, terminated, _, info = env.step(call("submit", {}))
        assert terminated
        return reward, info["grade"]
    finally:
        env.close()


def test_python_start_up_files_cannot_fake_a_pass(backend):
    """usercustomize.py and a .pth file in the user site (under HOME), and exported
    PYTHONPATH / PYTEST_PLUGINS: each would load the plugin into the grader's pytest."""
    plant = (
        f"site=$(python3 -m site --user-site) && mkdir -p $site /app/lib && "
        f"printf '%s' {_shell(PASS_EVERYTHING)} > $site/passall.py && "
        f"cp $site/passall.py /app/lib/passall.py && "
        'printf \'import os\\nos.environ["PYTEST_PLUGINS"] = "passall"\\n\' '
        "> $site/usercustomize.py && "
        'echo \'import os; os.environ["PYTEST_PLUGINS"] = "passall"\' > $site/passall.pth && '
        "cp $site/usercustomize.py /app/lib/sitecustomize.py && "
        "echo 'export PYTHONPATH=/app/lib PYTEST_PLUGINS=passall' >> ~/.bashrc && "
        "export PYTHONPATH=/app/lib PYTEST_PLUGINS=passall && "
        "cd /tests 2>/dev/null; python3 -c 'import os; print(os.environ.get(\"PYTEST_PLUGINS\"))'"
    )
    reward, grade = gamed_reward(backend, plant)
    assert (reward, grade) == (0.0, "1/2 tests passed") or reward == 0.0, grade


def test_a_process_left_running_cannot_finish_the_task_during_grading(backend):
    """A background process named like the container's keep-alive (`sleep`) waits for the
    grader's tests to appear and writes the answer they expect."""
    plant = (
        "cp /bin/bash /tmp/sleep && "
        "( /tmp/sleep -c 'while :; do "
        '  v=$(grep -o "== \\"[0-9]*\\"" /tests/test_outputs.py 2>/dev/null | tr -dc 0-9); '
        '  [ -n "$v" ] && echo $v > /app/count.txt; /bin/sleep 0.01; done\' '
        ">/dev/null 2>&1 & ) ; echo started"
    )
    reward, grade = gamed_reward(backend, plant)
    assert reward == 0.0, grade


def _shell(text):
    return "'" + text.replace("'", "'\\''") + "'"
