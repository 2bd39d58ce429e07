import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_toolcall_benchmark_prints_its_table_with_ratios():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.perf.toolcall",
            "--episodes",
            "3",
            "--sets",
            "simple_python,multi_turn_base,tau2_airline",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if "│" in line and "/s" not in line]
    assert "1.00x" in rows[0] and "baseline" in result.stdout
    assert any(row.strip("│ ").startswith("tau2_airline") for row in rows)
