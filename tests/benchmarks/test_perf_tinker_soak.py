"""The Tinker soak benchmark run tiny: both tables printed, every client done, no 5xx."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_soak_prints_memory_and_waits_and_no_5xx():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.perf.tinker_soak", "--clients", "2", "--steps", "2"]
        + ["--points", "2", "--group", "2", "--max-tokens", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "growth after warm-up" in out
    assert re.search(r"RSS MB", out) and "wait per request" in out
    rows = re.findall(
        r"│\s+(\d)\s+│\s+(\d+)\s+│\s+[\d.]+\s+│\s+[\d.]+\s+│\s+[\d.]+\s+│\s+(\d+)", out
    )
    assert [(client, steps) for client, _, steps in rows] == [("0", "2"), ("1", "2")]
    assert "5xx answers: 0" in out and "failed clients: 0" in out
