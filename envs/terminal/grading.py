"""Graders of the terminal env.

- terminal-bench tasks: after the agent stops, every process in its sandbox is killed, the
  tests are (re)written to /tests, where the agent could not have planted anything that
  stays, and run by pytest in a fresh shell; the reward is 1 when every test passed and 0
  otherwise (the fraction passed is in the info).
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

import json
import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from envs.sandbox import Sandbox, SandboxError
from envs.terminal.tasks import TerminalTask

_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|XPASS)\s+(\S+)", re.MULTILINE)
_SNAPSHOT_FILE = "/tmp/.clawgym-snapshot.json"
_SNAPSHOT = r"""python3 - >%(out)s <<'__CLAWGYM_SNAPSHOT__'
import hashlib, json, os, sys
seen = {}
def entry(path):
    if os.path.islink(path):
        return "link:" + os.readlink(path)
    if os.path.isdir(path):
        return "dir"
    try:
        with open(path, "rb") as handle:
            return hashlib.md5(handle.read(1 << 26)).hexdigest()
    except OSError:
        return "unreadable"
for root in %(roots)s:
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(top, name)
            if not name.startswith(".clawgym-"):
                seen[path] = entry(path)
json.dump(seen, sys.stdout)
__CLAWGYM_SNAPSHOT__"""


@dataclass(frozen=True)
class Verdict:
    """A grader's reward and what it saw."""

    reward: float
    summary: str
    details: dict[str, Any] = field(default_factory=dict)


# -- terminal-bench -------------------------------------------------------------------------
def grade_tbench(sandbox: Sandbox, task: TerminalTask) -> Verdict:
    """Runs the task's tests in the agent's sandbox after a clean restart of its shell."""
    sandbox.restart_shell()
    sandbox.exec("rm -rf /tests 2>/dev/null; true", timeout=30)
    for path, content in task.tests:
        sandbox.write_file(f"/tests/{path}", content)
    result = sandbox.exec(
        f"export TEST_DIR=/tests; cd {task.workdir} && {{ {task.test_command}; }} 2>&1",
        timeout=task.test_timeout,
    )
    outcomes = _SUMMARY.findall(result.stdout)
    passed = sum(1 for outcome, _ in outcomes if outcome in ("PASSED", "XPASS"))
    total = len(outcomes)
    reward = 1.0 if total and passed == total else 0.0
    summary = f"{passed}/{total} tests passed" + (" (tests timed out)" if result.timed_out else "")
    details = {"tests_passed": passed, "tests_total": total, "test_output": result.stdout[-4000:]}
    return Verdict(reward, summary, details)


# -- InterCode-ALFA -------------------------------------------------------------------------
def snapshot(sandbox: Sandbox, roots: tuple[str, ...]) -> dict[str, str]:
    """Path -> content hash ("dir", "link:<target>") of everything under `roots`."""
    script = _SNAPSHOT % {"out": _SNAPSHOT_FILE, "roots": json.dumps([*roots, "/tmp"])}
    result = sandbox.exec(script, timeout=60)
    if result.exit_code != 0:
        raise SandboxError(f"file-system snapshot failed: {result.stderr[-500:]}")
    data = json.loads(sandbox.read_file(_SNAPSHOT_FILE))
    sandbox.exec(f"rm -f {_SNAPSHOT_FILE}", timeout=30)
    return {str(path): str(value) for path, value in data.items()}


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
    result = sandbox.exec(
        "bash /tmp/.clawgym-setup.sh >/dev/null 2>&1; status=$?; rm -f /tmp/.clawgym-setup.sh; "
        "exit $status",
        timeout=300,
    )
    if result.timed_out or result.exit_code in (126, 127):
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
