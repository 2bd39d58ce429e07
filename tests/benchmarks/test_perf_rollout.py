"""The rollout benchmark, run small: both settings play turns, the table prints their ratios
and the JSON holds the same figures, on the embedded engine (with its prefix cache off and
on, side by side) and on vLLM (with the server's own figures); `--engine` takes only the
engines it knows; the vLLM server's counters are read from Prometheus text as vLLM writes
it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.perf.rollout import VLLM_COUNTERS, prometheus_sums

ROOT = Path(__file__).resolve().parents[2]


def run_small(engine: str, out: Path, *more: str) -> subprocess.CompletedProcess[str]:
    """The benchmark on `engine`: chat and arith, 1 and 2 groups in flight, 3 s windows."""
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.perf.rollout", "--engine", engine]
        + ["--envs", "chat,arith", "--in-flight", "1", "2", "--seconds", "3", "--warmup", "1"]
        + ["--out", str(out), *more],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return result


def test_rollout_benchmark_prints_its_table_with_ratios(tmp_path):
    out = tmp_path / "rollout.json"
    result = run_small("embedded", out, "--prefix-cache-tokens", "0", "4096")
    turns_row = next(line for line in result.stdout.splitlines() if "turns/s" in line)
    assert "(1.00x)" in turns_row
    assert "vLLM" not in result.stdout  # the server's rows are vllm's alone
    assert "each run over its model's first" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(row["prefix_cache_tokens"], row["in_flight"]) for row in rows] == [
        (0, 1),
        (0, 2),
        (4096, 1),
        (4096, 2),
    ]
    for row in rows:
        assert row["engine"] == "embedded" and row["model"] == "tiny"
        assert row["turns"] > 0 and row["completion_tokens"] >= row["turns"]
        assert row["turns_per_s"] == row["turns"] / row["window_s"]
        assert set(row["by_env"]) == {"chat", "arith"} and row["failed"] == 0
        assert row["server"] == {}
        prompt_tokens, cached = row["prefilled"]
        assert prompt_tokens > 0
        assert (cached > 0) == (row["prefix_cache_tokens"] > 0)  # every env shares a prompt


@pytest.mark.slow  # 45 s; vLLM serving runs by default in tests/trainers/test_run_vllm.py
@pytest.mark.vllm
def test_on_vllm_the_table_adds_the_servers_own_figures(tmp_path):
    out = tmp_path / "rollout.json"
    result = run_small("vllm", out)  # about 30 s, 20 of them vLLM's start
    assert "CPU cores, vLLM server" in result.stdout and "vLLM engine steps/s" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(row["engine"], row["in_flight"]) for row in rows] == [("vllm", 1), ("vllm", 2)]
    for row in rows:
        assert row["turns"] > 0 and row["failed"] == 0
        server = row["server"]
        assert server["cpu_s"] > 0 and server["steps"] > 0 and server["generated"] > 0
        assert 0 < server["prefix_hits"] <= server["prefix_queried"]  # the turns share prompts


def test_an_unknown_engine_is_refused_before_anything_starts():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.perf.rollout", "--engine", "embedded,sglang"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "unknown engine sglang: choose from embedded, vllm" in result.stderr


def test_prometheus_counters_are_summed_over_their_labels():
    text = "\n".join(
        [
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            'vllm:generation_tokens_total{engine="0",model_name="tiny"} 120.0',
            'vllm:generation_tokens_total{engine="1",model_name="tiny"} 30.0',
            'vllm:iteration_tokens_total_bucket{engine="0",le="1.0"} 4.0',
            'vllm:iteration_tokens_total_count{engine="0",model_name="tiny"} 17.0',
            "vllm:prefix_cache_hits_total 2.5e+03",
        ]
    )
    sums = prometheus_sums(text, list(VLLM_COUNTERS.values()))
    assert sums["vllm:generation_tokens_total"] == 150.0
    assert sums["vllm:iteration_tokens_total_count"] == 17.0
    assert sums["vllm:prefix_cache_hits_total"] == 2500.0
    assert sums["vllm:prefix_cache_queries_total"] == 0.0
