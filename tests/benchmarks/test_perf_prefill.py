"""The prefill benchmark, run small on `tiny`: the split engine computes fewer columns than
the one-pass engine, and the same tokens."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_prefill_benchmark_compares_passes_with_one_pass(tmp_path):
    out = tmp_path / "prefill.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.perf.prefill", "--model", "tiny", "--short", "6"]
        + ["--wide", "2", "--tokens", "4", "--rounds", "1", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "embedded prefill, tiny" in result.stdout
    rows = {row["setting"]: row for row in json.loads(out.read_text())}
    assert list(rows) == ["one pass", "passes"]
    assert rows["one pass"]["prefill_ratio"] == 1.0
    assert rows["passes"]["columns"] < rows["one pass"]["columns"]
    # every column computed is a prompt token or padding: never fewer than the tokens left
    assert rows["passes"]["columns"] >= 8
    for row in rows.values():
        assert row["same_tokens"], row
        assert row["max_dlogp"] < 1e-4, row
