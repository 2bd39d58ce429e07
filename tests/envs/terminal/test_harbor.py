"""Harbor task folders in clawgym/Terminal-v0: the shipped tasks converted to Harbor form pass
the gold test (solve.sh earns 1, the idle agent 0) on a sample by default and on every task
under `slow`, on bubblewrap and on Docker (their Dockerfiles built locally); malformed
folders fail with an error that names the problem; reward files parse as Harbor's do."""

import json
import shutil

import pytest

from envs.sandbox import SandboxError
from envs.terminal.env import TerminalEnv, load_task_set
from envs.terminal.grading import parse_reward
from envs.terminal.harbor import (
    convert_tbench,
    load_harbor,
    load_harbor_task,
    shipped_harbor,
)
from envs.terminal.tasks import SHIPPED, load_tbench
from tests.envs.terminal.test_terminal import call, gold_check

SAMPLE = ["harbor/archive-project", "harbor/fix-python-bug", "harbor/write-primes"]


def _files(root):
    return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_tasks_harbor_is_the_converted_terminal_bench_tasks(tmp_path):
    """`tasks=harbor` reads what the converter writes from the shipped tasks today, and each
    task loads with the same instruction, solution and tests."""
    convert_tbench(SHIPPED, tmp_path)
    converted = shipped_harbor()
    assert _files(tmp_path) == _files(converted)
    old = {t.task_id.split("/")[1]: t for t in load_tbench(str(SHIPPED))}
    new = {t.task_id.split("/")[1]: t for t in load_harbor(str(converted))}
    assert old.keys() == new.keys() and len(new) == 23
    for name, task in new.items():
        assert task.instruction == old[name].instruction and task.solution == old[name].solution
        assert dict(old[name].tests).items() <= dict(task.tests).items()
        assert task.test_timeout == old[name].test_timeout and task.workdir == "/app"


def test_an_edited_task_is_converted_anew(tmp_path, monkeypatch):
    monkeypatch.setenv("CLAWGYM_HOME", str(tmp_path / "home"))
    source = tmp_path / "tbench"
    shutil.copytree(SHIPPED / "count-lines", source / "count-lines")
    first = shipped_harbor(source)
    assert shipped_harbor(source) == first  # converted once
    task = source / "count-lines" / "task.yaml"
    task.write_text(task.read_text().replace("Count the lines", "Count all lines"))
    second = shipped_harbor(source)
    assert second != first
    assert "Count all lines" in (second / "count-lines" / "instruction.md").read_text()
    assert not [p for p in second.parent.iterdir() if p.name.startswith(".")]  # no staging left


def test_harbor_task_sets_and_splits():
    shipped = load_task_set("harbor", "all")
    assert load_task_set(f"harbor:{shipped_harbor()}", "all").keys() == shipped.keys()
    train, test = load_task_set("harbor", "train"), load_task_set("harbor", "test")
    assert train.keys().isdisjoint(test.keys()) and len(train) + len(test) == len(shipped)


def test_gold_on_a_sample(backend):
    env = TerminalEnv(tasks="harbor", split="all", sandbox=backend, max_turns=2)
    try:
        gold_check(env, SAMPLE if backend == "bwrap" else SAMPLE[:2])
    finally:
        env.close()


@pytest.mark.slow
def test_gold_on_every_shipped_task(backend):
    env = TerminalEnv(tasks="harbor", split="all", sandbox=backend, max_turns=2)
    try:
        gold_check(env, env.task_ids())
    finally:
        env.close()


def test_a_reward_file_planted_by_the_agent_does_not_count(backend):
    """The agent writes a reward of 1 where test.sh writes its own, and its tests' expected
    output nowhere: grading happens in a fresh sandbox, so the reward is 0."""
    plant = "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt"
    env = TerminalEnv(tasks="harbor", split="all", sandbox=backend, max_turns=3)
    try:
        env.reset(options={"task_id": "harbor/count-lines"})
        env.step(call("bash", {"command": plant}))
        _, reward, terminated, _, info = env.step(call("submit", {}))
        assert (reward, terminated, info["grade"]) == (0.0, True, "reward 0")
    finally:
        env.close()


def harbor_folder(root, name="hello", dockerfile="FROM clawgym/sandbox-base\nWORKDIR /app\n"):
    """A minimal Harbor task folder: write hi to /app/hi.txt; test.sh writes reward.json."""
    task = root / name
    for sub in ("environment", "tests", "solution"):
        (task / sub).mkdir(parents=True)
    (task / "instruction.md").write_text("Write hi to /app/hi.txt\n")
    (task / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 30\n')
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    (task / "tests" / "test.sh").write_text(
        "mkdir -p /logs/verifier\n"
        'if [ "$(cat /app/hi.txt)" = hi ]; then r=1; else r=0; fi\n'
        'echo "{\\"reward\\": $r}" > /logs/verifier/reward.json\n'
    )
    (task / "solution" / "solve.sh").write_text("echo hi > /app/hi.txt\n")
    return task


def test_a_harbor_folder_with_copy_env_and_reward_json_runs(tmp_path, backend):
    """COPY of a context file, ENV, RUN with a continuation, an ignored CMD and a reward.json
    verifier, with solve.sh and the idle agent."""
    dockerfile = (
        "# a comment\nFROM clawgym/sandbox-base\nENV GREETING=hello\nWORKDIR /app\n"
        "COPY data/seed.txt /app/seed.txt\nRUN cat /app/seed.txt > /app/copy.txt && \\\n"
        '    echo done >> /app/copy.txt\nCMD ["bash"]\n'
    )
    task = harbor_folder(tmp_path, dockerfile=dockerfile)
    (task / "environment" / "data").mkdir()
    (task / "environment" / "data" / "seed.txt").write_text("seed\n")
    (task / "solution" / "solve.sh").write_text(
        '[ "$GREETING" = hello ] && [ "$(cat copy.txt)" = "$(printf "seed\\ndone")" ] '
        "&& echo hi > /app/hi.txt\n"
    )
    env = TerminalEnv(tasks=f"harbor:{tmp_path}", split="all", sandbox=backend, max_turns=2)
    try:
        assert env.task_ids() == ["harbor/hello"]
        env.reset(options={"task_id": "harbor/hello"})
        assert env.sandbox.read_file("/app/copy.txt") == b"seed\ndone\n"
        if backend == "docker":  # built from the Dockerfile, not set up by a script
            assert env.sandbox.image.startswith("clawgym/harbor-hello:") and not env.task.setup
        gold_check(env, ["harbor/hello"])
    finally:
        env.close()


def test_a_failing_build_step_is_a_clear_error(tmp_path, backend):
    harbor_folder(tmp_path, dockerfile="FROM clawgym/sandbox-base\nWORKDIR /app\nRUN exit 3\n")
    env = TerminalEnv(tasks=f"harbor:{tmp_path}", split="all", sandbox=backend)
    try:
        with pytest.raises(SandboxError, match="(building the image of hello|setup of .*) failed"):
            env.reset(options={"task_id": "harbor/hello"})
    finally:
        env.close()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda t: (t / "instruction.md").unlink(), "has no instruction.md"),
        (lambda t: (t / "tests" / "test.sh").unlink(), "has no tests/test.sh"),
        (lambda t: (t / "environment" / "Dockerfile").unlink(), "has no environment/Dockerfile"),
        (lambda t: (t / "solution" / "solve.sh").unlink(), "has no solution/solve.sh"),
        (lambda t: (t / "task.toml").write_text("[verifier\n"), "is not valid TOML"),
        (
            lambda t: (t / "task.toml").write_text("[agent]\ntimeout_sec = 'soon'\n"),
            r"\[agent\] timeout_sec must be a positive number",
        ),
        (
            lambda t: (t / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\n"),
            "FROM ubuntu:24.04 is not allowed: images are never pulled",
        ),
        (
            lambda t: (t / "environment" / "Dockerfile").write_text(
                "FROM clawgym/sandbox-base:0123456789ab\n"
            ),
            "is not allowed",
        ),
        (
            lambda t: (t / "environment" / "Dockerfile").write_text("RUN true\n"),
            "does not start with FROM",
        ),
    ],
)
def test_a_malformed_harbor_folder_is_a_clear_error(tmp_path, damage, message):
    task = harbor_folder(tmp_path)
    load_harbor_task(task)  # whole, it loads
    damage(task)
    with pytest.raises(ValueError, match=message):
        load_harbor_task(task)


def test_an_empty_folder_and_what_bwrap_cannot_build_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="no Harbor task folders"):
        load_task_set(f"harbor:{tmp_path}", "all")
    harbor_folder(tmp_path, dockerfile="FROM clawgym/sandbox-base\nUSER nobody\n")
    with pytest.raises(ValueError, match="cannot run under bwrap: .*USER nobody.*sandbox=docker"):
        TerminalEnv(tasks=f"harbor:{tmp_path}", split="all", sandbox="bwrap")


def test_reward_files_parse_as_harbor_reads_them():
    assert parse_reward({"reward.txt": "0.75\n"}) == (0.75, "reward 0.75")
    assert parse_reward({"reward.txt": "1", "reward.json": '{"reward": 0}'})[0] == 1.0
    assert parse_reward({"reward.json": json.dumps({"reward": 0.5, "style": 1})})[0] == 0.5
    assert parse_reward({"reward.json": '{"accuracy": 1}'})[0] == 1.0
    assert parse_reward({"reward.json": '{"a": 1, "b": 1}'})[0] == 0.0
    assert parse_reward({"reward.txt": "yes"}) == (0.0, parse_reward({"reward.txt": "yes"})[1])
    assert "does not parse" in parse_reward({"reward.txt": "yes"})[1]
    assert parse_reward({"reward.txt": "nan"})[0] == 0.0
    assert parse_reward({}) == (0.0, "no reward file was written")
