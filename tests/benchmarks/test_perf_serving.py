"""The serving benchmark's proxy table, run small: every row is printed with a figure."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_serving_benchmark_prints_the_proxy_table():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.perf.serving", "--only", "proxy"]
        + ["--requests", "5", "--servers", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for row in ("proxy overhead p50", "floor: round trip to a no-op server", "requests/s, 32"):
        assert row in out
    floor = re.search(r"no-op server p50\s*│\s*([\d.]+) ms", out)
    assert floor and 0 < float(floor.group(1)) < 100
    failed = re.search(r"failed requests during publishes\s*│\s*(\d+) of (\d+)", out)
    assert failed and failed.group(1) == "0" and int(failed.group(2)) > 0
