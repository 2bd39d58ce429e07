import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_store_benchmark_prints_its_table_with_ratios():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.perf.store", "--turns", "40", "--tokens", "64"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if "x │" in line]
    assert len(rows) == 4 and "1.00x" in rows[0]
