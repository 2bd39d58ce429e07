"""The factory's parts and the shipped instance set: its size, variety and honesty (no
problem statement shows the fix), and the SWE-bench-format loader."""

import ast
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from envs.swe.instances import SHIPPED, SWEInstance, load_instances, select_split
from envs.swe.mutate import mutations
from envs.swe.sources import BY_REPO
from envs.swe.tasks import failure_excerpt, fix_patch

SOURCE = """\
def clamp(value, low, high):
    if value < low:
        return low
    return min(value, high) + 0


def unused(a, b):
    return a and b
"""


def test_mutations_are_one_line_parsable_and_limited_to_covered_lines():
    found = list(mutations("m.py", SOURCE, covered={2, 4}))
    assert {m.line for m in found} == {2, 4}
    assert {m.kind for m in found} >= {"compare", "binop", "constant", "arguments"}
    for mutation in found:
        mutated = mutation.apply(SOURCE)
        ast.parse(mutated)
        changed = [
            i
            for i, (a, b) in enumerate(zip(SOURCE.splitlines(), mutated.splitlines(), strict=True))
            if a != b
        ]
        assert changed == [mutation.line - 1] and mutation.function == "clamp"
    compare = next(m for m in found if m.kind == "compare")
    assert compare.after == "    if value <= low:"


def test_fix_patch_is_a_git_diff_of_one_line():
    buggy = SOURCE.replace("value < low", "value <= low")
    patch = fix_patch("pkg/m.py", buggy, SOURCE)
    assert patch.startswith("diff --git a/pkg/m.py b/pkg/m.py\n--- a/pkg/m.py\n+++ b/pkg/m.py\n")
    assert "-    if value <= low:\n+    if value < low:\n" in patch


def test_failure_excerpt_keeps_the_tests_frames_and_errors_but_not_library_frames():
    log = (
        "=== FAILURES ===\n"
        "___ TestA.test_b ___\n"
        "tests/test_x.py:10: in test_b\n"
        "    assert clamp(1, 2, 3) == 2\n"
        "src/pkg/m.py:4: in clamp\n"
        "    if value <= low:\n"
        "E   AssertionError: assert 1 == 2\n"
        "=== short test summary info ===\n"
    )
    excerpt = failure_excerpt(log, "tests/test_x.py::TestA::test_b")
    assert "assert clamp(1, 2, 3) == 2" in excerpt and "AssertionError: assert 1 == 2" in excerpt
    assert "value <= low" not in excerpt and "src/pkg" not in excerpt


@pytest.fixture(scope="module")
def shipped():
    return load_instances(SHIPPED)


def test_the_shipped_set_has_200_instances_from_8_projects(shipped):
    assert len(shipped) >= 200
    per_repo = {}
    for instance in shipped:
        per_repo[instance.repo] = per_repo.get(instance.repo, 0) + 1
    assert len(per_repo) >= 8 and set(per_repo) <= set(BY_REPO)
    assert len({i.instance_id for i in shipped}) == len(shipped)
    for instance in shipped:
        assert instance.fail_to_pass and instance.patch.startswith("diff --git")
        assert instance.version == BY_REPO[instance.repo].version
        assert not set(instance.fail_to_pass) & set(instance.pass_to_pass)


def test_no_problem_statement_shows_the_patch(shipped):
    for instance in shipped:
        changed = [
            line[1:].strip()
            for line in instance.patch.splitlines()
            if line[:1] in "+-" and not line.startswith(("+++", "---"))
        ]
        for line in changed:
            assert line not in instance.problem_statement, instance.instance_id
        assert instance.fail_to_pass[0] in instance.problem_statement


def test_splits_are_disjoint_and_cover_the_set(shipped):
    train, test = select_split(shipped, "train"), select_split(shipped, "test")
    assert train.keys().isdisjoint(test.keys()) and len(train) + len(test) == len(shipped)
    assert 0.1 < len(test) / len(shipped) < 0.3


def _record(instance: SWEInstance) -> dict:
    record = instance.to_record()
    # the hub's SWE-bench files hold the test lists as JSON strings
    record["FAIL_TO_PASS"] = json.dumps(record["FAIL_TO_PASS"])
    record["PASS_TO_PASS"] = json.dumps(record["PASS_TO_PASS"])
    record["created_at"] = "2024-01-01T00:00:00Z"
    return record


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
def test_the_loader_reads_swe_bench_files(tmp_path, shipped, suffix):
    records = [_record(i) for i in shipped[:3]]
    path = tmp_path / f"instances{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(records))
    elif suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in records))
    else:
        pq.write_table(pa.Table.from_pylist(records), path)
    loaded = load_instances(path)
    assert loaded == shipped[:3]
    assert loaded[0].meta["created_at"] == "2024-01-01T00:00:00Z"


def test_a_record_without_tests_is_refused():
    with pytest.raises(ValueError, match="FAIL_TO_PASS"):
        SWEInstance.from_record(
            {"instance_id": "x", "repo": "a/b", "patch": "", "PASS_TO_PASS": []}
        )
