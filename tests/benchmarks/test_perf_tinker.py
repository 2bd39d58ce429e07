import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tinker_step_benchmark_prints_both_learners_with_the_ratio():
    command = [sys.executable, "-m", "benchmarks.perf.tinker", "--model", "tiny"]
    command += ["--batch", "2", "--tokens", "32", "--steps", "1"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if "x │" in line]
    assert len(rows) == 3 and "1.00x" in rows[0] and "through Tinker" in rows[2]
