"""Graders of the terminal env.

- terminal-bench tasks: after the agent stops, its work directory (and nothing else) is
  carried into a fresh sandbox set up from the pristine task; the tests are written to
  /tests there and run from an empty environment, so what the agent planted outside its
  work directory, in its shell or in Python's and pytest's start-up paths, and every
  process it started, take no part; the reward is 1 when every test passed and 0
  otherwise (the fraction passed is in the info).
- Harbor tasks: the same fresh sandbox, carried work directory, pristine /tests and empty
  environment; `tests/test.sh` runs under the verifier's timeout and the reward is what it
  wrote to /logs/verifier/reward.txt (a number) or reward.json (its "reward" entry, or its
  only entry), read by the host afterwards; no reward file, or one that does not parse,
  is 0.
- InterCode-ALFA tasks, graded as InterCode does: the gold command runs in a fresh sandbox
  set up like the agent's; the reward is 0.01 + 0.33 x (file-system changes match, by the
  complement of the error function of the number of differing paths) + 0.33 x (files both
  changed have the same content) + 0.33 x (the agent's last command is the gold command,
  or its output equals the gold's, or else the TF-IDF cosine similarity of the two
  outputs). Departures: modified files are compared by content as well as added ones; an
  episode in which the agent ran no command earns 0; and when contents differ, the gold
  runs once more, and files it writes differently each time (timestamps, `date`) are not
  held against the agent.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import tarfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from envs.sandbox import ExecResult, Sandbox, SandboxError
from envs.terminal.tasks import TerminalTask

_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|XPASS)\s+(\S+)", re.MULTILINE)
# What the tests run under: an empty environment but for these (no PYTHONPATH, PYTHONSTARTUP
# or PYTEST_ADDOPTS of the agent's choosing), Python without user site-packages and without
# the working directory on its path, a fresh HOME.
_TEST_ENV = (
    ("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
    ("HOME", "/tmp"),
    ("LANG", "C.UTF-8"),
    ("TERM", "dumb"),
    ("PYTHONNOUSERSITE", "1"),
    ("PYTHONSAFEPATH", "1"),
    ("PYTHONDONTWRITEBYTECODE", "1"),
)


@dataclass(frozen=True)
class Verdict:
    """A grader's reward and what it saw."""

    reward: float
    summary: str
    details: dict[str, Any] = field(default_factory=dict)


# -- terminal-bench -------------------------------------------------------------------------
def grade_tbench(
    make: Callable[[TerminalTask], Sandbox], agent: Sandbox, task: TerminalTask
) -> Verdict:
    """Runs the task's tests on what the agent left in its work directory, carried into a
    fresh sandbox set up from the pristine task: nothing the agent started, planted
    elsewhere (its /tmp, its shell, its exports) or left running takes part, and the tests
    run from an empty environment (`_TEST_ENV`)."""
    try:
        work = agent.export_tree(task.workdir)
    except SandboxError as error:
        return Verdict(0.0, f"not graded: {error}", {"tests_passed": 0, "tests_total": 0})
    with make(task) as sandbox:
        result = run_tests(sandbox, task, work)
    outcomes = _SUMMARY.findall(result.stdout)
    passed = sum(1 for outcome, _ in outcomes if outcome in ("PASSED", "XPASS"))
    total = len(outcomes)
    reward = 1.0 if total and passed == total else 0.0
    summary = f"{passed}/{total} tests passed" + (" (tests timed out)" if result.timed_out else "")
    details = {"tests_passed": passed, "tests_total": total, "test_output": result.stdout[-4000:]}
    return Verdict(reward, summary, details)


def run_tests(sandbox: Sandbox, task: TerminalTask, work: bytes) -> ExecResult:
    """Sets `sandbox` up from the pristine task, puts the agent's work directory `work` in
    place, writes the tests to /tests and runs them from an empty environment."""
    prepare(sandbox, task)
    sandbox.exec(f"find {_quote(task.workdir)} -mindepth 1 -delete", timeout=60)
    sandbox.import_tree(task.workdir, work)
    for path, content in task.tests:
        sandbox.write_file(f"/tests/{path}", content)
    environment = (*_TEST_ENV, ("TEST_DIR", "/tests"), *task.env)
    return sandbox.exec(
        isolated(f"cd {_quote(task.workdir)} && {{ {task.test_command}; }} 2>&1", environment),
        timeout=task.test_timeout,
    )


# -- Harbor ---------------------------------------------------------------------------------
def grade_harbor(
    make: Callable[[TerminalTask], Sandbox], agent: Sandbox, task: TerminalTask
) -> Verdict:
    """Runs a Harbor task's tests/test.sh as `grade_tbench` runs tests (fresh sandbox, only
    the work directory carried over) and reads the reward file it wrote."""
    try:
        work = agent.export_tree(task.workdir)
    except SandboxError as error:
        return Verdict(0.0, f"not graded: {error}", {})
    with make(task) as sandbox:
        sandbox.exec("rm -rf /logs/verifier && mkdir -p /logs/verifier", timeout=60)
        result = run_tests(sandbox, task, work)
        files = {}
        for name in ("reward.txt", "reward.json"):
            try:
                files[name] = sandbox.read_file(f"/logs/verifier/{name}").decode(errors="replace")
            except SandboxError:
                continue
    reward, summary = parse_reward(files)
    if result.timed_out:
        summary += " (tests timed out)"
    details = {"test_exit_code": result.exit_code, "test_output": result.stdout[-4000:]}
    return Verdict(reward, summary, details)


def parse_reward(files: dict[str, str]) -> tuple[float, str]:
    """The reward (and how it was found) from the contents of Harbor's reward files by
    name; reward.txt wins over reward.json, as in Harbor."""
    try:
        if "reward.txt" in files:
            reward = float(files["reward.txt"].strip())
        elif "reward.json" in files:
            rewards = json.loads(files["reward.json"])
            if not isinstance(rewards, dict) or not rewards:
                return 0.0, "reward.json holds no rewards"
            value = rewards["reward"] if "reward" in rewards else next(iter(rewards.values()))
            if len(rewards) > 1 and "reward" not in rewards:
                return 0.0, f"reward.json has several rewards and none named 'reward': {rewards}"
            reward = float(value)
        else:
            return 0.0, "no reward file was written"
    except (ValueError, TypeError, KeyError) as error:
        return 0.0, f"the reward file does not parse: {error}"
    if not math.isfinite(reward):
        return 0.0, f"the reward is not a finite number: {reward}"
    return reward, f"reward {reward:g}"


def isolated(command: str, environment: Sequence[tuple[str, str]]) -> str:
    """`command` run by a bash that starts from `environment` alone."""
    assignments = " ".join(f"{key}={_quote(value)}" for key, value in environment)
    return f"env -i {assignments} bash --noprofile --norc -c {_quote(command)}"


# -- InterCode-ALFA -------------------------------------------------------------------------
def snapshot(sandbox: Sandbox, roots: tuple[str, ...]) -> dict[str, str]:
    """Path -> content hash ("dir", "link:<target>") of everything under `roots` and /tmp,
    read by the host from the sandbox's files (nothing runs inside it that the agent could
    have prepared; a fifo is not opened). Kills the sandbox's processes first."""
    found: dict[str, str] = {}
    for root in (*roots, "/tmp"):
        with tarfile.open(fileobj=io.BytesIO(sandbox.export_tree(root)), mode="r:") as tar:
            for member in tar:
                if member.name.rsplit("/", 1)[-1].startswith(".clawgym-"):
                    continue
                path = f"{root.rstrip('/')}/{member.name}"
                if member.isdir():
                    found[path] = "dir"
                elif member.issym():
                    found[path] = "link:" + member.linkname
                else:
                    handle = tar.extractfile(member)
                    content = handle.read(1 << 26) if handle is not None else b""
                    found[path] = hashlib.md5(content).hexdigest()
    return found


def changes(before: dict[str, str], after: dict[str, str]) -> dict[str, str]:
    """Path -> "A" (added), "M" (modified) or "D" (deleted)."""
    found = {p: "A" for p in after.keys() - before.keys()}
    found |= {p: "D" for p in before.keys() - after.keys()}
    found |= {p: "M" for p in after.keys() & before.keys() if after[p] != before[p]}
    return found


@dataclass(frozen=True)
class Run:
    """What one command did: its combined output and the file system after it."""

    command: str
    output: str
    before: dict[str, str]
    after: dict[str, str]


def run_gold(make: Callable[[TerminalTask], Sandbox], task: TerminalTask) -> Run:
    """The gold command run in a fresh sandbox set up like the agent's."""
    with make(task) as sandbox:
        prepare(sandbox, task)
        before = snapshot(sandbox, task.writable)
        result = sandbox.exec(task.solution, timeout=task.command_timeout)
        after = snapshot(sandbox, task.writable)
    return Run(task.solution, result.stdout + result.stderr, before, after)


def unstable_paths(first: Run, second: Run) -> frozenset[str]:
    """Paths two runs of the same gold command left with different contents."""
    paths = first.after.keys() | second.after.keys()
    return frozenset(p for p in paths if first.after.get(p) != second.after.get(p))


def prepare(sandbox: Sandbox, task: TerminalTask) -> None:
    """Runs the task's setup script in a child bash (the agent's shell stays clean)."""
    if not task.setup:
        return
    sandbox.write_file("/tmp/.clawgym-setup.sh", task.setup)
    # `(exit N)` sets the status without ending the sandbox's shell: a bare `exit` there made
    # every set-up a shell that exited and was replaced (logged as such, a new shell started)
    result = sandbox.exec(
        "bash /tmp/.clawgym-setup.sh >/dev/null 2>&1; status=$?; rm -f /tmp/.clawgym-setup.sh; "
        "(exit $status)",
        timeout=300,
    )
    failed = task.kind == "harbor" and result.exit_code != 0
    if result.timed_out or result.exit_code in (126, 127) or failed:
        raise SandboxError(f"the setup of {task.task_id} failed (exit code {result.exit_code})")


def grade_icalfa(agent: Run | None, gold: Run, unstable: frozenset[str] = frozenset()) -> Verdict:
    """InterCode's reward for the agent's run against the gold command's. Files in
    `unstable` (the gold itself writes them differently each run, e.g. with `date`) count
    as matching whatever their content."""
    if agent is None:
        return Verdict(0.0, "no command was run", {})
    agent_changes = changes(agent.before, agent.after)
    gold_changes = changes(gold.before, gold.after)
    agent_set, gold_set = set(agent_changes.items()), set(gold_changes.items())
    missing, extra = gold_set - agent_set, agent_set - gold_set
    file_diff = round(0.33 * (1 - math.erf(len(missing) + len(extra))), 2)
    common = [p for p, status in agent_set & gold_set if status in ("A", "M")]
    mismatched = sorted(
        p for p in common if p not in unstable and agent.after.get(p) != gold.after.get(p)
    )
    same = len(common) - len(mismatched)
    file_changes = round(0.33 * same / len(common), 2) if common else 0.33
    if agent.command.strip() == gold.command.strip() or agent.output == gold.output:
        similarity = 1.0
    else:
        similarity = tfidf_similarity(agent.output, gold.output)
    answer = round(0.33 * similarity, 2)
    reward = round(0.01 + file_diff + file_changes + answer, 2)
    details = {
        "file_diff": file_diff,
        "file_changes": file_changes,
        "answer_similarity": answer,
        "diff_missing": sorted(p for p, _ in missing)[:20],
        "diff_extra": sorted(p for p, _ in extra)[:20],
        "content_mismatch": mismatched[:20],
    }
    return Verdict(reward, f"InterCode reward {reward:.2f}", details)


_TOKEN = re.compile(r"(?u)\b\w\w+\b")


def tfidf_similarity(first: str, second: str) -> float:
    """Cosine similarity of two texts' TF-IDF vectors, as scikit-learn's TfidfVectorizer
    computes them by default (lower-cased words of 2+ characters, smoothed idf, l2 norm)."""
    docs = [Counter(_TOKEN.findall(text.lower())) for text in (first, second)]
    if not docs[0] or not docs[1]:
        return 1.0 if first == second else 0.0
    vocabulary = set(docs[0]) | set(docs[1])
    idf = {w: math.log(3 / (1 + sum(w in d for d in docs))) + 1 for w in vocabulary}
    vectors = [{w: count * idf[w] for w, count in doc.items()} for doc in docs]
    norms = [math.sqrt(sum(v * v for v in vector.values())) for vector in vectors]
    dot = sum(value * vectors[1].get(w, 0.0) for w, value in vectors[0].items())
    return dot / (norms[0] * norms[1])


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"
