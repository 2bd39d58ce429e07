"""Grading of SWE instances, decided by swebench's own log parser and grading functions.

The agent's diff is applied to a clean workspace of the instance (never the one the agent
worked in: what it left running or installed there does not count); changes it made to the
instance's test files are dropped and the instance's `test_patch` is applied on top, as
SWE-bench's harness does. The test files of FAIL_TO_PASS and PASS_TO_PASS run under pytest
with `-rA`; `swebench.harness.log_parsers` turns the log into a status map and
`swebench.harness.grading` decides: resolved when every FAIL_TO_PASS test passes and every
PASS_TO_PASS test still does.

Predictions are written in SWE-bench's format (`instance_id`, `model_name_or_path`,
`model_patch`, one JSON object a line) beside a report with each instance's verdict.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from envs.sandbox import Sandbox, SandboxError
from envs.sandbox.trees import filter_archive
from envs.swe.instances import SWEInstance
from envs.swe.sources import BY_REPO, TESTBED, Project
from envs.swe.workspace import Workspaces, heredoc

TEST_LOG = "/tmp/.clawgym-test.log"
REWARDS = ("binary", "fraction")
_DIFF_FILE = re.compile(r"^diff --git a/(\S+) b/(\S+)", re.MULTILINE)


@dataclass(frozen=True)
class Report:
    """The verdict on one patch for one instance.

    Attributes:
        instance_id: the instance.
        resolved: every FAIL_TO_PASS test passes and every PASS_TO_PASS test still does.
        status: swebench's RESOLVED_FULL, RESOLVED_PARTIAL or RESOLVED_NO.
        patch_applied: the patch applied to a clean copy (an empty patch applies).
        tests_status: swebench's report: FAIL_TO_PASS / PASS_TO_PASS -> success / failure.
        log: the tail of the test run's output.
        reason: why the patch was not graded, where it was not.
    """

    instance_id: str
    resolved: bool
    status: str
    patch_applied: bool
    tests_status: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    log: str = ""
    reason: str = ""

    @property
    def fraction(self) -> float:
        """Fraction of the FAIL_TO_PASS and PASS_TO_PASS tests that pass."""
        groups = [self.tests_status.get(k, {}) for k in ("FAIL_TO_PASS", "PASS_TO_PASS")]
        passed = sum(len(g.get("success", [])) for g in groups)
        total = passed + sum(len(g.get("failure", [])) for g in groups)
        return passed / total if total else 0.0

    @property
    def summary(self) -> str:
        if self.reason:
            return f"not resolved: {self.reason}"
        if not self.patch_applied:
            return "the patch did not apply to a clean copy: not resolved"
        f2p, p2p = (self.tests_status.get(k, {}) for k in ("FAIL_TO_PASS", "PASS_TO_PASS"))
        counts = [
            f"{len(g.get('success', []))}/{len(g.get('success', [])) + len(g.get('failure', []))}"
            for g in (f2p, p2p)
        ]
        verdict = "resolved" if self.resolved else "not resolved"
        return f"{verdict} (FAIL_TO_PASS {counts[0]} pass, PASS_TO_PASS {counts[1]} pass)"

    def reward(self, kind: str = "binary") -> float:
        """binary: +1 resolved, else -1; fraction: the fraction of tests that pass."""
        if kind not in REWARDS:
            raise ValueError(f"unknown reward {kind!r}; choose one of {', '.join(REWARDS)}")
        if kind == "fraction":
            return self.fraction
        return 1.0 if self.resolved else -1.0


def test_files(tests: Iterable[str]) -> list[str]:
    """The files of pytest node ids, in order of first appearance."""
    return list(dict.fromkeys(t.split("::")[0] for t in tests))


# The test run's interpreter: isolated (-I: no PYTHON* variable, no user site-packages, not
# the working directory on sys.path), pytest imported from the installed packages before
# the project's directories join sys.path, and then behind the standard library, so no
# module of the patch shadows the test runner or the standard library.
_RUNNER = (
    "import sys\n"
    "import pytest\n"
    "split = sys.argv.index('--')\n"
    "site = next((i for i, p in enumerate(sys.path) if p.endswith(('site-packages', "
    "'dist-packages'))), len(sys.path))\n"
    "sys.path[site:site] = sys.argv[1:split]\n"
    "sys.exit(pytest.main(sys.argv[split + 1:]))\n"
)
_TEST_ENV = (
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/tmp LANG=C.UTF-8 "
    # PYTHONHASHSEED=0: ids of tests parametrized from sets stay the same from run to run
    "COLUMNS=240 PYTHONHASHSEED=0 PYTHONDONTWRITEBYTECODE=1"
)


def test_command(files: Sequence[str], timeout: float, pythonpath: str = TESTBED) -> str:
    """The pytest run of `files` whose log swebench's pytest parser reads; the log goes to
    a file, as a suite's full `-rA` log can be longer than a command's output cap. It runs
    from an empty environment with an isolated interpreter (`_RUNNER`); `pythonpath` is
    the project's import path (`Project.pythonpath`)."""
    quoted = " ".join(_quote(f) for f in files)
    paths = " ".join(_quote(p) for p in pythonpath.split(":") if p)
    # -o addopts= : a project's own addopts (coverage, xdist) would need plugins not here
    return (
        f"cd {TESTBED} && env -i {_TEST_ENV} timeout -k 5 {int(timeout)} "
        f"python3 -I -c {_quote(_RUNNER)} {paths} -- "
        f"-rA --tb=short -p no:cacheprovider -o addopts= {quoted} >{TEST_LOG} 2>&1"
    )


def status_map(log: str, repo: str = "") -> dict[str, str]:
    """Test id -> PASSED / FAILED / ERROR / SKIPPED / XFAIL, by swebench's parser."""
    from swebench.harness.log_parsers.python import MAP_REPO_TO_PARSER_PY, parse_log_pytest

    parser = MAP_REPO_TO_PARSER_PY.get(repo, parse_log_pytest)
    return dict(parser(log, None))  # the pytest parsers do not read their test spec


def run_tests(
    sandbox: Sandbox, files: Sequence[str], timeout: float = 300.0, command: str | None = None
) -> tuple[str, bool]:
    """Runs the test files (or `command`, which writes TEST_LOG) in a fresh shell of the
    sandbox; the full log and whether the run timed out."""
    sandbox.restart_shell()
    pythonpath = dict(sandbox.config.env).get("PYTHONPATH", TESTBED)
    result = sandbox.exec(command or test_command(files, timeout, pythonpath), timeout=timeout + 30)
    try:
        log = sandbox.read_file(TEST_LOG).decode(errors="replace")
    except SandboxError:
        log = result.stdout + result.stderr
    return log, result.timed_out or result.exit_code == 124


def without_files(patch: str, files: Iterable[str]) -> str:
    """The patch without its changes to `files` (the agent may not edit the tests)."""
    banned = set(files)
    starts = [m.start() for m in _DIFF_FILE.finditer(patch)]
    if not starts:
        return patch
    kept = [patch[: starts[0]]]
    for begin, end in zip(starts, [*starts[1:], len(patch)], strict=True):
        section = patch[begin:end]
        match = _DIFF_FILE.match(section)
        assert match is not None
        if match.group(1) not in banned and match.group(2) not in banned:
            kept.append(section)
    return "".join(kept)


# Paths the grader never takes from the agent, whatever its patch says: they decide how the
# tests run rather than what the project does (test files, pytest's configuration and
# conftest files, the interpreter's start-up files, bytecode and package metadata that
# Python or pytest would load, git's attributes).
_RUNNER_FILES = frozenset(
    {
        "conftest.py",
        "pytest.ini",
        ".pytest.ini",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        "sitecustomize.py",
        "usercustomize.py",
        ".gitattributes",
        ".gitmodules",
    }
)
_RUNNER_SUFFIXES = (".pth", ".pyc", ".pyo", ".so", ".dist-info", ".egg-info", ".egg-link")
_TEST_DIRS = frozenset({"test", "tests", "testing"})
_STATUS_FILE = "/tmp/.clawgym-status"
_PATCH_FILE = "/tmp/.clawgym-patch.diff"
_RESTORE_FILE = "/tmp/.clawgym-restore"
_FROM_FILE = f"--pathspec-from-file={_RESTORE_FILE} --pathspec-file-nul"
# git in the grader's own repository: no system or global configuration, no attributes file
_GIT = (
    "env GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null HOME=/tmp git -c core.quotePath=false "
    "-c core.attributesFile=/dev/null -c core.fileMode=true -c core.hooksPath=/dev/null"
)


def is_protected(path: str, added: bool, package: str, tests: Iterable[str]) -> bool:
    """Whether the grader keeps the pristine `path` (relative to /testbed) rather than the
    agent's: a test or test-runner file (see `_RUNNER_FILES`), or a file the agent added
    outside the project's package (a new top-level module could shadow what the tests
    import)."""
    parts = path.split("/")
    name = parts[-1]
    if path in set(tests) or name in _RUNNER_FILES:
        return True
    if any(p == "__pycache__" or p in _TEST_DIRS or p.endswith(_RUNNER_SUFFIXES) for p in parts):
        return True
    if name.startswith("test_") or name.endswith("_test.py"):
        return True
    return added and not (path == package or path.startswith(package.rstrip("/") + "/"))


def carried_patch(
    workspaces: Workspaces, instance: SWEInstance, tree: bytes
) -> tuple[str, list[str]]:
    """The agent's change as a patch, and the paths left out of it: its /testbed (`tree`, an
    `export_tree` archive taken with its processes killed) is carried into a fresh
    workspace of the instance, whose git repository is the grader's own, and diffed there,
    so no configuration, hook or attribute the agent set changes what the diff says. The
    diff is read whole from a file, never through a command's output cap."""
    project = project_of(instance.repo, instance.version)
    tests = {*test_files([*instance.fail_to_pass, *instance.pass_to_pass])}
    tests |= {m.group(2) for m in _DIFF_FILE.finditer(instance.test_patch)}
    files = filter_archive(tree, TESTBED, _carried)
    with workspaces.open(project, instance.patch) as sandbox:
        sandbox.exec(f"find {TESTBED} -mindepth 1 -maxdepth 1 ! -name .git -exec rm -rf {{}} +")
        sandbox.import_tree(TESTBED, files)
        _git(sandbox, f"add -A && {_GIT} diff --cached --name-status -z --no-renames HEAD")
        fields = sandbox.read_file(_STATUS_FILE).decode(errors="replace").split("\0")
        changed = list(zip(fields[0::2], fields[1::2], strict=False))
        dropped = sorted(
            (path, status)
            for status, path in changed
            if path and is_protected(path, status == "A", project.package, tests)
        )
        added = [path for path, status in dropped if status == "A"]
        kept = [path for path, status in dropped if status != "A"]
        if added:  # the agent's new runner files go
            sandbox.write_file(_RESTORE_FILE, "\0".join(added) + "\0")
            _git(sandbox, f"rm -q -f --cached {_FROM_FILE} && xargs -0 rm -f -- <{_RESTORE_FILE}")
        if kept:  # the pristine ones come back
            sandbox.write_file(_RESTORE_FILE, "\0".join(kept) + "\0")
            _git(sandbox, f"checkout HEAD {_FROM_FILE}")
        _git(
            sandbox,
            f"add -A && {_GIT} diff --cached --no-color --no-ext-diff --no-textconv "
            "--no-renames HEAD",
            output=_PATCH_FILE,
        )
        patch = sandbox.read_file(_PATCH_FILE).decode(errors="replace")
    return patch, [path for path, _ in dropped]


def _carried(name: str) -> bool:
    """What of the agent's tree is carried at all: not its git repository or attributes."""
    return name.split("/")[0] != ".git" and name.rsplit("/", 1)[-1] != ".gitattributes"


def _git(sandbox: Sandbox, command: str, output: str | None = _STATUS_FILE) -> None:
    """Runs `git <command>` at /testbed in the grader's configuration, stdout to `output`."""
    target = f" >{output}" if output else ""
    result = sandbox.exec(f"cd {TESTBED} && {_GIT} {command}{target}", timeout=120)
    if result.exit_code != 0:
        raise SandboxError(f"git {command.split()[0]} failed: {result.stderr[-500:]}")


def apply_patch(sandbox: Sandbox, patch: str) -> bool:
    """Applies a diff at /testbed (strictly, then leniently); whether it applied."""
    if not patch.strip():
        return True
    for options in ("", "--recount --ignore-whitespace --reject"):
        command = heredoc(f"cd {TESTBED} && git apply --whitespace=nowarn {options}", patch)
        if sandbox.exec(command, timeout=60).exit_code == 0:
            return True
    return False


def decide(
    instance_id: str, log: str, fail_to_pass: Sequence[str], pass_to_pass: Sequence[str], repo: str
) -> Report:
    """The swebench verdict on a test log."""
    from swebench.harness.grading import get_eval_tests_report, get_resolution_status

    gold = {"FAIL_TO_PASS": list(fail_to_pass), "PASS_TO_PASS": list(pass_to_pass)}
    report = get_eval_tests_report(status_map(log, repo), gold)
    status = get_resolution_status(report)
    tests = {k: report[k] for k in ("FAIL_TO_PASS", "PASS_TO_PASS")}
    return Report(instance_id, status == "RESOLVED_FULL", status, True, tests, log[-6000:])


def project_of(repo: str, version: str) -> Project:
    """The shipped project an instance runs on; raises with the reason otherwise."""
    project = BY_REPO.get(repo)
    if project is None or project.version != version:
        known = ", ".join(f"{p.repo}@{p.version}" for p in BY_REPO.values())
        raise ValueError(f"no workspace for {repo}@{version}; workspaces exist for {known}")
    return project


def grade(
    workspaces: Workspaces, instance: SWEInstance, model_patch: str, timeout: float = 300.0
) -> Report:
    """Applies `model_patch` to a clean workspace of `instance`, runs its FAIL_TO_PASS and
    PASS_TO_PASS test files and lets swebench decide."""
    project = project_of(instance.repo, instance.version)
    tests = [*instance.fail_to_pass, *instance.pass_to_pass]
    files = test_files(tests)
    protected = set(files) | {m.group(2) for m in _DIFF_FILE.finditer(instance.test_patch)}
    with workspaces.open(project, instance.patch) as sandbox:
        if not apply_patch(sandbox, without_files(model_patch, protected)):
            return Report(instance.instance_id, False, "RESOLVED_NO", False)
        if not apply_patch(sandbox, instance.test_patch):
            raise ValueError(f"the test_patch of {instance.instance_id} does not apply")
        log, _ = run_tests(sandbox, files, timeout)
    return decide(
        instance.instance_id, log, instance.fail_to_pass, instance.pass_to_pass, instance.repo
    )


@dataclass(frozen=True)
class Prediction:
    """One row of a SWE-bench predictions file."""

    instance_id: str
    model_name_or_path: str
    model_patch: str


def write_predictions(
    folder: Path, predictions: Sequence[Prediction], reports: Sequence[Report]
) -> tuple[Path, Path]:
    """Writes `predictions.jsonl` (SWE-bench's format) and `report.json` (per instance
    verdicts and totals) in `folder`; their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    predictions_path = folder / "predictions.jsonl"
    with predictions_path.open("w") as handle:
        for prediction in predictions:
            handle.write(json.dumps(asdict(prediction)) + "\n")
    by_id = {r.instance_id: r for r in reports}
    summary: dict[str, Any] = {
        "total_instances": len(predictions),
        "completed_instances": len(by_id),
        "resolved_instances": sum(r.resolved for r in by_id.values()),
        "resolved_ids": sorted(i for i, r in by_id.items() if r.resolved),
        "unresolved_ids": sorted(i for i, r in by_id.items() if not r.resolved),
        "instances": {
            i: {
                "resolved": r.resolved,
                "status": r.status,
                "patch_applied": r.patch_applied,
                "tests_status": r.tests_status,
            }
            for i, r in sorted(by_id.items())
        },
    }
    report_path = folder / "report.json"
    report_path.write_text(json.dumps(summary, indent=2))
    return predictions_path, report_path


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"
