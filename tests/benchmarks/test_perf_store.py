import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_store_benchmark_prints_its_tables_with_ratios():
    command = [sys.executable, "-m", "benchmarks.perf.store", "--turns", "40", "--tokens", "64"]
    result = subprocess.run(
        [*command, "--episodes", "2", "--episode-turns", "4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if "x │" in line]
    assert len(rows) == 6 and "1.00x" in rows[0]
    inline, addressed = rows[4:]
    assert "inline" in inline and "1.00x" in inline
    # screenshots repeat in every later prompt: kept once, a turn takes fewer bytes
    assert float(addressed.split("│")[-2].strip().rstrip("x")) > 1.5
