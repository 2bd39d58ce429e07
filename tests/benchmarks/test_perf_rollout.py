"""The rollout benchmark, run small: both settings play turns, the table prints their ratios
and the JSON holds the same figures."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_rollout_benchmark_prints_its_table_with_ratios(tmp_path):
    out = tmp_path / "rollout.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.perf.rollout", "--envs", "chat,arith"]
        + ["--in-flight", "1", "2", "--seconds", "3", "--warmup", "1", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    turns_row = next(line for line in result.stdout.splitlines() if "turns/s" in line)
    assert "(1.00x)" in turns_row
    rows = json.loads(out.read_text())["rows"]
    assert [row["in_flight"] for row in rows] == [1, 2]
    for row in rows:
        assert row["turns"] > 0 and row["completion_tokens"] >= row["turns"]
        assert row["turns_per_s"] == row["turns"] / row["window_s"]
        assert set(row["by_env"]) == {"chat", "arith"} and row["failed"] == 0
