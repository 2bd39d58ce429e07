"""SWE-v0's grader against a hostile agent that does not fix the bug, on both backends: a
conftest or a start-up file that passes every test, git configuration that hides its edits
of the tests from the grader, a process left running, and (the other way round) a correct
fix whose diff is longer than the command-output cap, which must still be graded whole."""

import json
import time

import pytest

from envs.swe.env import SWEEnv
from envs.swe.sources import BY_REPO

# A pytest plugin that makes every test pass without running it.
PASS_EVERYTHING = (
    "import pytest\n"
    "@pytest.hookimpl(hookwrapper=True)\n"
    "def pytest_runtest_call(item):\n"
    "    item.runtest = lambda: None\n"
    "    yield\n"
)


def call(name, **arguments):
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": function}]}


@pytest.fixture
def env(backend):
    env = SWEEnv(split="all", sandbox=backend, max_turns=6, pool=0)
    yield env
    env.close()


def first_of(env, repo):
    return next(i for i in env.task_ids() if env.instances[i].repo == repo)


def played(env, task_id, *actions):
    """The submit's reward and grade after `actions` (tool calls) and a submit."""
    env.reset(options={"task_id": task_id})
    for action in actions:
        env.step(action)
    _, reward, terminated, _, info = env.step(call("submit"))
    assert terminated
    return reward, info


def bash(command):
    return call("bash", command=command)


def test_a_conftest_that_passes_every_test_is_left_out(env):
    """A new conftest.py at the root and beside the tests, and a changed pytest config."""
    task_id = first_of(env, "cpburnz/python-pathspec")
    reward, info = played(
        env,
        task_id,
        call("editor", command="create", path="conftest.py", file_text=PASS_EVERYTHING),
        call("editor", command="create", path="tests/conftest.py", file_text=PASS_EVERYTHING),
        bash("printf '[pytest]\\naddopts = -p conftest\\n' > /testbed/pytest.ini"),
    )
    assert reward == -1.0, info["grade"]
    assert {"conftest.py", "tests/conftest.py", "pytest.ini"} <= set(info["left_out"])


def test_python_start_up_files_on_the_import_path_are_left_out(env):
    """sitecustomize.py and a .pth file where the project's import path would load them."""
    task_id = first_of(env, "tkem/cachetools")
    hook = "import os; os.environ['PYTEST_PLUGINS'] = 'passall'\n"
    reward, info = played(
        env,
        task_id,
        call("editor", command="create", path="src/passall.py", file_text=PASS_EVERYTHING),
        call("editor", command="create", path="src/sitecustomize.py", file_text=hook),
        call("editor", command="create", path="src/passall.pth", file_text=hook),
    )
    assert reward == -1.0, info["grade"]
    assert "src/sitecustomize.py" in info["left_out"]


# Appended to a test module: every test in it becomes one that passes without a check.
HOLLOW = """
def _hollow(names):
    for name, value in list(names.items()):
        if isinstance(value, type):
            for attr in list(vars(value)):
                if attr.startswith("test"):
                    setattr(value, attr, lambda self, *a, **k: None)
        elif name.startswith("test") and callable(value):
            names[name] = lambda *a, **k: None
_hollow(globals())
"""


def test_git_configuration_cannot_hide_edits_of_the_tests(env):
    """diff.mnemonicPrefix renames the a/ b/ prefixes the grader looked for; with it the
    agent's edit of the test files (every test hollowed out) slipped into the patch."""
    task_id = first_of(env, "cpburnz/python-pathspec")
    files = sorted({t.split("::")[0] for t in env.instances[task_id].fail_to_pass})
    appends = [
        call("bash", command=f"cat >> /testbed/{path} <<'EOF'\n{HOLLOW}EOF") for path in files
    ]
    reward, info = played(
        env, task_id, bash("cd /testbed && git config diff.mnemonicPrefix true"), *appends
    )
    assert reward == -1.0, info["grade"]
    assert set(files) <= set(info["left_out"])


def test_a_process_left_running_does_not_take_part(env, backend):
    """A process named like the container's keep-alive (`sleep`), left running, which would
    edit the modules once the grader touches the repository (its index changes). Nothing
    of the agent's may be alive once the diff is taken: its heartbeat file stops growing."""
    task_id = first_of(env, "cpburnz/python-pathspec")
    watcher = (
        "cd /testbed; seen=$(stat -c %y:%s .git/index); while :; do echo >> /tmp/heartbeat; "
        '[ "$(stat -c %y:%s .git/index)" = "$seen" ] || '
        "for f in $(git ls-files | grep -v ^tests/ | grep .py$); do "
        'echo "# clawgym-was-here" >> $f; done; /bin/sleep 0.01; done'
    )
    reward, info = played(
        env,
        task_id,
        bash(
            f"cp /bin/bash /tmp/sleep && ( /tmp/sleep -c {_quote(watcher)} >/dev/null 2>&1 & ); "
            "sleep 0.2; echo started"
        ),
    )
    assert "clawgym-was-here" not in info["model_patch"] and reward == -1.0
    beats = len(env.sandbox.read_file("/tmp/heartbeat"))
    assert beats > 0  # it ran while the agent played
    time.sleep(0.5)
    assert len(env.sandbox.read_file("/tmp/heartbeat")) == beats


def _quote(text):
    return "'" + text.replace("'", "'\\''") + "'"


def test_a_correct_fix_longer_than_the_output_cap_is_graded_whole(env):
    task_id = first_of(env, "cpburnz/python-pathspec")
    instance = env.instances[task_id]
    package = BY_REPO[instance.repo].package
    padding = "".join(f"# explanation line {n:05d} of a long fix\n" for n in range(800))
    reward, info = played(
        env,
        task_id,
        bash(f"cd /testbed && git apply <<'EOF'\n{instance.patch}EOF"),
        call("editor", command="create", path=f"{package}/_notes.py", file_text=padding),
    )
    assert len(info["model_patch"]) > 16 * 1024
    assert reward == 1.0, info["grade"]
