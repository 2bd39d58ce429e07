"""No agent action ends a training run: each route an agent found to raise out of `step` or
the next `reset` (a fifo where the grader reads, a directory nested 1,200 levels deep, a
file name too long or a path under /proc for the editor) ends as an observation or a
truncated episode with its reason, on both backends."""

import json
import os
import time

import pytest

from envs.swe.env import SWEEnv
from envs.terminal.env import TerminalEnv

DEEP = "mkdir -p \"$(printf 'd/%.0s' $(seq 1200))\" && echo made"


def call(name, **arguments):
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": function}]}


@pytest.mark.parametrize("task_id", ["tbench/count-lines", "icalfa/000"])
def test_a_fifo_in_the_work_directory_does_not_hang_or_break_grading(backend, task_id):
    tasks = task_id.split("/")[0]
    env = TerminalEnv(tasks=tasks, split="all", sandbox=backend, max_turns=4)
    try:
        env.reset(options={"task_id": task_id})
        where = "/app" if tasks == "tbench" else "/testbed"
        env.step(call("bash", command=f"mkfifo {where}/pipe /tmp/.clawgym-snapshot.json; ls"))
        started = time.monotonic()
        _, reward, terminated, _, info = env.step(call("submit"))
        assert terminated and "aborted" not in info, info
        assert tasks == "icalfa" or reward == 0.0, info
        assert time.monotonic() - started < 60
    finally:
        env.close()


def test_a_deep_directory_is_graded_and_the_next_reset_cleans_up(backend):
    env = TerminalEnv(tasks="tbench", split="all", sandbox=backend, max_turns=4)
    try:
        env.reset(options={"task_id": "tbench/count-lines"})
        observation, *_ = env.step(call("bash", command=f"cd /app && {DEEP}"))
        assert "made" in observation[0]["content"]
        _, reward, terminated, _, info = env.step(call("submit"))
        assert (reward, terminated) == (0.0, True) and "deeper than" in info["grade"]
        root = getattr(env.sandbox, "root", None)
        env.reset(options={"task_id": "tbench/count-lines"})
        assert root is None or not os.path.exists(root)  # bwrap: the host directory went
    finally:
        env.close()


def test_a_deep_directory_in_a_swe_workspace_ends_as_a_grade(backend):
    env = SWEEnv(split="all", sandbox=backend, max_turns=4, pool=0)
    try:
        env.reset(options={"task_id": env.task_ids()[0]})
        env.step(call("bash", command=f"cd /testbed && {DEEP}"))
        _, reward, terminated, _, info = env.step(call("submit"))
        assert (reward, terminated) == (-1.0, True) and "deeper than" in info["grade"], info
        env.reset(options={"task_id": env.task_ids()[0]})
    finally:
        env.close()


@pytest.mark.parametrize(
    "arguments",
    [
        {"command": "create", "path": "/testbed/" + "n" * 300 + ".py", "file_text": "x = 1\n"},
        {"command": "create", "path": "/proc/sys/kernel/clawgym", "file_text": "1\n"},
        {"command": "view", "path": "/proc/1/mem"},
        {"command": "view", "path": "/testbed/pipe"},
        {"command": "str_replace", "path": "/testbed/pipe", "old_str": "a", "new_str": "b"},
    ],
    ids=["long-name", "proc-write", "proc-read", "fifo-view", "fifo-edit"],
)
def test_editor_errors_are_observations(backend, arguments):
    env = SWEEnv(split="all", sandbox=backend, max_turns=6, pool=0)
    try:
        env.reset(options={"task_id": env.task_ids()[0]})
        env.step(call("bash", command="mkfifo /testbed/pipe"))
        started = time.monotonic()
        observation, reward, terminated, truncated, info = env.step(call("editor", **arguments))
        assert not (terminated or truncated) and "aborted" not in info, observation
        assert observation[0]["content"].startswith("[error]"), observation
        assert time.monotonic() - started < 90
    finally:
        env.close()
