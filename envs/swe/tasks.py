"""The SWE task factory: SWE-bench-format instances from real projects, offline.

    python -m envs.swe.tasks build --per-project 25 --workers 2      # extends the shipped set
    python -m envs.swe.tasks validate                                  # gold / empty sweep

For each project of `sources.py` (fetched by `python -m envs.swe.sources`) it runs the test
suite once in a bwrap sandbox with a line tracer (the baseline and which lines the tests
execute), then tries single-line AST mutations of executed lines (`mutate.py`) one at a time:
a bug is kept only when some tests that passed now fail (FAIL_TO_PASS) and every other test
still passes; PASS_TO_PASS are the passing tests of the failing tests' files (the files the
grader runs). The fix (`patch`) is the diff back to the released code. The problem statement
is written from what a user sees, the failing test and its assertion output, never from the
patch: frames inside the library, which would show the mutated line, are left out. A kept
instance is validated through the grader itself: the gold patch must resolve it and the
empty patch must not. One bug per function keeps the set varied.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import logging
import random
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from envs.sandbox import SandboxConfig
from envs.sandbox.bwrap import BwrapSandbox
from envs.swe.grading import TEST_LOG, grade, run_tests, status_map, test_files
from envs.swe.instances import SHIPPED, SWEInstance, load_instances, save_instances
from envs.swe.mutate import Mutation, mutations
from envs.swe.sources import BY_NAME, PROJECTS, TESTBED, Project, fetch
from envs.swe.workspace import Workspaces, _copy_tree, project_config

logger = logging.getLogger(__name__)

PASSING = ("PASSED", "XFAIL")
_COVERAGE = "/tmp/.clawgym-coverage.py"
_COVERAGE_OUT = "/tmp/.clawgym-coverage.json"
# Runs pytest under a line tracer limited to the package's files: which lines the tests run.
_COVERAGE_SCRIPT = r"""
import json, sys, threading
import pytest
root, out = sys.argv[1], sys.argv[2]
hits = {}
def tracer(frame, event, arg):
    name = frame.f_code.co_filename
    if not name.startswith(root):
        return None
    lines = hits.setdefault(name, set())
    def local(frame, event, arg):
        if event == "line":
            lines.add(frame.f_lineno)
        return local
    return local
sys.settrace(tracer)
threading.settrace(tracer)
try:
    code = pytest.main(sys.argv[3:])
finally:
    sys.settrace(None)
    with open(out, "w") as handle:
        json.dump({k: sorted(v) for k, v in hits.items()}, handle)
sys.exit(int(code))
"""
_SECTION = re.compile(r"^_{3,} (.+?) _{3,}$", re.MULTILINE)
_FRAME = re.compile(r"^(\S+\.py):\d+: in ")


def instance_id(project: Project, mutation: Mutation) -> str:
    """`<owner>__<repo>-<version>.<hash of the mutation>`."""
    digest = hashlib.sha256(f"{mutation.path}:{mutation.line}:{mutation.after}".encode())
    owner_repo = project.repo.replace("/", "__")
    return f"{owner_repo}-{project.version}.{digest.hexdigest()[:8]}"


def fix_patch(path: str, buggy: str, fixed: str) -> str:
    """The git-style diff that turns the buggy file back into the released one."""
    lines = difflib.unified_diff(
        buggy.splitlines(keepends=True),
        fixed.splitlines(keepends=True),
        fromfile=f"a/{path}",
        tofile=f"b/{path}",
    )
    return f"diff --git a/{path} b/{path}\n" + "".join(lines)


def failure_excerpt(log: str, test: str, limit: int = 1800) -> str:
    """What pytest showed for `test`'s failure: the test's own frames and the error lines,
    without frames in library code (they would show the faulty line)."""
    file = test.split("::")[0]
    title = ".".join(test.split("::")[1:])
    sections = _SECTION.split(log)
    body = ""
    for name, text in zip(sections[1::2], sections[2::2], strict=False):
        if name in (title, f"ERROR at setup of {title}", f"ERROR at call of {title}"):
            body = text
            break
    kept: list[str] = []
    in_test_frame = False
    for line in body.splitlines():
        frame = _FRAME.match(line)
        if frame:
            in_test_frame = frame.group(1) == file
            if in_test_frame:
                kept.append(line)
        elif line.startswith("E "):
            kept.append(line)
        elif in_test_frame and line.startswith("    ") and line.strip():
            kept.append(line)
        if line.startswith(("=", "-" * 10)):
            break
    text = "\n".join(kept[:30]).strip()
    return text[:limit] + ("\n..." if len(text) > limit else "")


def problem_statement(project: Project, fail_to_pass: Sequence[str], log: str) -> str:
    """An issue as a user files it: what fails and how, and how to see it."""
    first = fail_to_pass[0]
    others = [t for t in fail_to_pass[1:]]
    excerpt = failure_excerpt(log, first) or "(no assertion output)"
    name = first.split("::")[-1]
    text = [
        f"{name} fails with {project.name} {project.version}",
        "",
        f"Running the project's tests, `{first}` fails"
        + (f", and {len(others)} other test(s) fail too." if others else ".")
        + " Here is what pytest prints:",
        "",
        "```",
        excerpt,
        "```",
        "",
        f"To reproduce: `python -m pytest {first}`",
    ]
    if others:
        listed = "\n".join(f"- `{t}`" for t in others[:8])
        more = f"\n- ... and {len(others) - 8} more" if len(others) > 8 else ""
        text += ["", "Also failing:", listed + more]
    text += ["", "These tests passed before and should pass again, without changing the tests."]
    return "\n".join(text)


class ProjectBuilder:
    """Builds instances of one project in one bwrap sandbox.

    Args:
        project: the project.
        seed: orders the candidate mutations.
        max_fail: most FAIL_TO_PASS tests an instance may have (a bug that breaks half
            the suite is a crash, not an issue).
        per_function: most bugs kept in one function (a project with few functions
            needs more than one).
    """

    def __init__(self, project: Project, seed: int = 0, max_fail: int = 25, per_function: int = 1):
        self.project = project
        self.rng = random.Random(f"{seed}:{project.key}")
        self.max_fail = max_fail
        self.per_function = per_function
        config = project_config(project, SandboxConfig(timeout=600.0, memory_mb=2048))
        self.sandbox = BwrapSandbox(config)
        self.root = Path(self.sandbox.mounts[TESTBED])

    def build(
        self, wanted: int, existing: dict[str, SWEInstance], max_attempts: int
    ) -> list[SWEInstance]:
        """Up to `wanted` new instances; `existing` ones (by id) count against the quotas."""
        fetched = fetch(self.project)
        _copy_tree(fetched, self.sandbox)
        started = time.monotonic()
        baseline, covered = self._baseline()
        limit = max(30.0, 5 * (time.monotonic() - started))
        passing = {t for t, s in baseline.items() if s in PASSING and _clean_id(t)}
        candidates = self._candidates(covered)
        logger.info(
            "%s: %d passing tests, %d candidate mutations",
            self.project.key,
            len(passing),
            len(candidates),
        )
        kept: list[SWEInstance] = []
        functions: dict[tuple[str, str], int] = {}
        attempts = 0
        for mutation in candidates:
            if len(kept) >= wanted or attempts >= max_attempts:
                break
            key = (mutation.path, mutation.function)
            taken = functions.get(key, 0) + sum(
                i.meta["mutation"]["function"] == mutation.function for i in existing.values()
            )
            if taken >= self.per_function or instance_id(self.project, mutation) in existing:
                continue
            attempts += 1
            instance = self._try(mutation, baseline, passing, limit)
            if instance is not None:
                kept.append(instance)
                functions[key] = functions.get(key, 0) + 1
                logger.info("%s: kept %s (%d)", self.project.key, instance.instance_id, len(kept))
        return kept

    def close(self) -> None:
        self.sandbox.close()

    def _baseline(self) -> tuple[dict[str, str], dict[str, set[int]]]:
        self.sandbox.write_file(_COVERAGE, _COVERAGE_SCRIPT)
        package = f"{TESTBED}/{self.project.package}"
        # the build runs the pristine project, not an agent's work: no isolation needed
        tests = " ".join(self.project.tests)
        command = (
            f"cd {TESTBED} && COLUMNS=240 PYTHONHASHSEED=0 python3 {_COVERAGE} {package} "
            f"{_COVERAGE_OUT} -rA --tb=short -p no:cacheprovider -o addopts= {tests} "
            f">{TEST_LOG} 2>&1"
        )
        log, _ = run_tests(self.sandbox, self.project.tests, 900, command)
        hits = json.loads(self.sandbox.read_file(_COVERAGE_OUT))
        covered = {str(Path(k).relative_to(TESTBED)): set(v) for k, v in hits.items()}
        return status_map(log), covered

    def _candidates(self, covered: dict[str, set[int]]) -> list[Mutation]:
        found: list[Mutation] = []
        for path, lines in sorted(covered.items()):
            source = (self.root / path).read_text()
            found.extend(mutations(path, source, lines))
        self.rng.shuffle(found)
        return found

    def _try(
        self, mutation: Mutation, baseline: dict[str, str], passing: set[str], limit: float
    ) -> SWEInstance | None:
        target = self.root / mutation.path
        fixed = target.read_text()
        buggy = mutation.apply(fixed)
        target.write_text(buggy)  # in place: the file keeps the sandbox's ownership
        try:
            log, timed_out = run_tests(self.sandbox, self.project.tests, limit)
        finally:
            target.write_text(fixed)
        if timed_out:
            return None
        after = status_map(log)
        failing = sorted(t for t in passing if after.get(t) not in PASSING)
        if not failing or len(failing) > self.max_fail:
            return None
        if any(after.get(t) is None for t in passing) or any(
            after.get(t) != baseline[t] for t in passing if t not in failing
        ):
            return None  # a test vanished (collection broke) or changed otherwise
        files = set(test_files(failing))
        still = sorted(t for t in passing if t not in failing and t.split("::")[0] in files)
        return SWEInstance(
            instance_id=instance_id(self.project, mutation),
            repo=self.project.repo,
            version=self.project.version,
            base_commit=f"sdist-sha256:{self.project.sha256[:16]}",
            problem_statement=problem_statement(self.project, failing, log),
            patch=fix_patch(mutation.path, buggy, fixed),
            test_patch="",
            fail_to_pass=tuple(failing),
            pass_to_pass=tuple(still),
            meta={
                "created_by": "clawgym.envs.swe.tasks (AST mutation)",
                "mutation": {"kind": mutation.kind, "function": mutation.function},
            },
        )


def _clean_id(test: str) -> bool:
    """Ids swebench's whitespace-splitting parser reads whole (no spaces in parameters)."""
    return test.count("[") == test.count("]")


def validate(instances: Sequence[SWEInstance], backend: str = "bwrap") -> list[str]:
    """Ids of instances the gold patch does not resolve or the empty patch does."""
    workspaces = Workspaces(backend)
    bad = []
    try:
        for instance in instances:
            gold = grade(workspaces, instance, instance.patch)
            empty = grade(workspaces, instance, "")
            if not gold.resolved or empty.resolved:
                logger.warning(
                    "%s: gold %s, empty %s", instance.instance_id, gold.status, empty.status
                )
                bad.append(instance.instance_id)
    finally:
        workspaces.close()
    return bad


def build(
    projects: Sequence[Project],
    per_project: int,
    out: Path = SHIPPED,
    workers: int = 1,
    seed: int = 0,
    max_attempts: int = 150,
    per_function: int = 1,
) -> list[SWEInstance]:
    """Extends the instance file at `out` to `per_project` validated instances a project."""
    current = load_instances(out) if out.exists() else []
    existing = {i.instance_id: i for i in current}

    def one(project: Project) -> list[SWEInstance]:
        have = sum(i.repo == project.repo for i in current)
        if have >= per_project:
            return []
        builder = ProjectBuilder(project, seed, per_function=per_function)
        mine = {k: v for k, v in existing.items() if v.repo == project.repo}
        try:
            made = builder.build(per_project - have, mine, max_attempts)
        finally:
            builder.close()
        bad = set(validate(made))
        logger.info("%s: %d made, %d failed validation", project.key, len(made), len(bad))
        return [i for i in made if i.instance_id not in bad]

    with ThreadPoolExecutor(max(1, workers)) as pool:
        for made in pool.map(one, projects):
            current.extend(made)
            save_instances(out, current)  # progress survives an interrupted build
    return current


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("build", help="make (or extend) an instance file")
    make.add_argument("--projects", default=",".join(p.name for p in PROJECTS))
    make.add_argument("--per-project", type=int, default=25)
    make.add_argument("--workers", type=int, default=1)
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--max-attempts", type=int, default=150)
    make.add_argument("--per-function", type=int, default=1)
    make.add_argument("--out", type=Path, default=SHIPPED)
    check = commands.add_parser("validate", help="gold resolves, empty patch does not")
    check.add_argument("--file", type=Path, default=SHIPPED)
    check.add_argument("--backend", default="bwrap")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.command == "build":
        chosen = [BY_NAME[name] for name in args.projects.split(",")]
        made = build(
            chosen,
            args.per_project,
            args.out,
            args.workers,
            args.seed,
            args.max_attempts,
            args.per_function,
        )
        logger.info("%d instances in %s", len(made), args.out)
    else:
        bad = validate(load_instances(args.file), args.backend)
        logger.info("%d instances failed validation: %s", len(bad), bad)
        if bad:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
