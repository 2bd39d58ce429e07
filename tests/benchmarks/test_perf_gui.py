import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.browser
def test_gui_benchmark_prints_its_table_with_ratios_against_selenium():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.perf.gui",
            "--tasks",
            "click-test",
            "--parallel",
            "1",
            "--episodes",
            "2",
            "--steps",
            "2",
            "--rounds",
            "1",
            "--observations",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if "x │" in line]
    assert len(rows) == 6
    assert "Selenium" in rows[0] and "1.00x" in rows[0]
    assert all("clawgym" in row for row in rows[1:])
    # the observation modes, each against DOM-only
    assert "observation=dom (baseline)" in rows[3] and "1.00x" in rows[3]
    assert "observation=screenshot" in rows[4] and "observation=both" in rows[5]
    # Every row ends with a CPU-per-step figure and its ratio to Selenium's.
    assert all(row.rstrip(" │").endswith("x") for row in rows)
