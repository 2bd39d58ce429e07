import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sandbox_benchmark_prints_its_table():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.perf.sandbox",
            "--backends",
            "bwrap",
            "--commands",
            "20",
            "--resets",
            "3",
            "--envs",
            "2",
            "--steps",
            "3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "bwrap: reset" in result.stdout and "Terminal-v0, 2 envs" in result.stdout
