import subprocess
import sys
from pathlib import Path

import pytest

from envs.swe.sources import PROJECTS, tree

ROOT = Path(__file__).resolve().parents[2]


def test_swe_benchmark_prints_reset_and_grading_rows():
    try:
        tree(PROJECTS[0])
    except FileNotFoundError as error:
        pytest.skip(str(error))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.perf.swe",
            "--resets",
            "2",
            "--grades",
            "1",
            "--episodes",
            "0",
            "--backends",
            "bwrap",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if "│" in line]
    assert any("bwrap: copy of tree" in row for row in rows)
    assert any("gold resolved 1/1" in row for row in rows)
