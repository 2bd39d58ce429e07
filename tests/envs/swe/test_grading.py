"""The grader's decisions (swebench's parser and grading functions on pytest logs), patch
filtering, rewards and the SWE-bench predictions export."""

import json

from envs.swe.grading import Prediction, Report, decide, without_files, write_predictions

F2P = ["tests/test_a.py::test_fixed"]
P2P = ["tests/test_a.py::test_kept", "tests/test_a.py::TestB::test_also[x-1]"]


def log(*lines):
    return "=== short test summary info ===\n" + "\n".join(lines) + "\n=== 3 passed ===\n"


def test_all_pass_is_resolved():
    report = decide(
        "i",
        log(
            "PASSED tests/test_a.py::test_fixed",
            "PASSED tests/test_a.py::test_kept",
            "PASSED tests/test_a.py::TestB::test_also[x-1]",
        ),
        F2P,
        P2P,
        "owner/repo",
    )
    assert report.resolved and report.status == "RESOLVED_FULL"
    assert report.reward("binary") == 1.0 and report.reward("fraction") == 1.0


def test_a_broken_pass_to_pass_test_is_not_resolved():
    report = decide(
        "i",
        log(
            "PASSED tests/test_a.py::test_fixed",
            "FAILED tests/test_a.py::test_kept - AssertionError: boom",
            "PASSED tests/test_a.py::TestB::test_also[x-1]",
        ),
        F2P,
        P2P,
        "owner/repo",
    )
    assert not report.resolved and report.tests_status["PASS_TO_PASS"]["failure"] == [P2P[0]]
    assert report.reward("binary") == -1.0 and abs(report.reward("fraction") - 2 / 3) < 1e-9


def test_a_test_missing_from_the_log_counts_as_failing():
    report = decide("i", log("PASSED tests/test_a.py::test_kept"), F2P, P2P[:1], "owner/repo")
    assert not report.resolved and report.tests_status["FAIL_TO_PASS"]["failure"] == F2P


def test_changes_to_protected_files_are_dropped_from_a_patch():
    patch = (
        "diff --git a/src/m.py b/src/m.py\n--- a/src/m.py\n+++ b/src/m.py\n@@ -1 +1 @@\n-a\n+b\n"
        "diff --git a/tests/test_a.py b/tests/test_a.py\n--- a/tests/test_a.py\n"
        "+++ b/tests/test_a.py\n@@ -1 +1 @@\n-x\n+y\n"
    )
    kept = without_files(patch, {"tests/test_a.py"})
    assert "src/m.py" in kept and "tests/test_a.py" not in kept


def test_predictions_are_written_in_swe_bench_format(tmp_path):
    predictions = [Prediction("a", "m", "diff"), Prediction("b", "m", "")]
    reports = [Report("a", True, "RESOLVED_FULL", True), Report("b", False, "RESOLVED_NO", True)]
    predictions_path, report_path = write_predictions(tmp_path, predictions, reports)
    rows = [json.loads(line) for line in predictions_path.read_text().splitlines()]
    assert rows[0] == {"instance_id": "a", "model_name_or_path": "m", "model_patch": "diff"}
    report = json.loads(report_path.read_text())
    assert report["resolved_ids"] == ["a"] and report["unresolved_ids"] == ["b"]
    assert report["instances"]["b"]["status"] == "RESOLVED_NO"
