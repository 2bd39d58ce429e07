"""The vLLM LoRA kernel benchmark, run small on `tiny`: both kernel sets and the embedded
reference are measured, and clawgym's kernels give base rows the base model's log-probs."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# 66 s here (two vLLM servers); the kernels' log-probs are checked on the shared server by
# tests/agents/engines/test_vllm.py in the default run
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_the_benchmark_prints_both_kernel_sets_and_the_reference():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.perf.vllm_lora", "--model", "tiny"]
        + ["--cores", "1", "--tokens", "8", "--concurrency", "1", "4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    number = r"([\d.]+(?:e[+-]\d+)?)"
    rows = {
        name: re.search(rf"{re.escape(name)}[^│]*│\s*{number}[^│]*│\s*{number}", result.stdout)
        for name in (
            "vLLM's own (baseline)",
            "clawgym's",
            "embedded engine, same cores (reference)",
        )
    }
    for name, row in rows.items():
        assert row and float(row.group(1)) > 0 and float(row.group(2)) > 0, name
    clawgym = re.search(rf"clawgym's.*│\s*{number}\s*│\s*{number}\s*│", result.stdout)
    assert clawgym, result.stdout
    assert float(clawgym.group(1)) < 1e-3 and float(clawgym.group(2)) < 1e-3
