"""The decode benchmark, run small on `tiny`: every setting decodes the baseline's tokens and
gets a rate and a ratio."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_benchmark_compares_every_setting_with_the_baseline(tmp_path):
    out = tmp_path / "decode.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.perf.decode", "--model", "tiny", "--rows", "4"]
        + ["--tokens", "6", "--rounds", "1", "--rank", "4", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "embedded decode, tiny" in result.stdout
    rows = {row["setting"]: row for row in json.loads(out.read_text())}
    assert list(rows) == ["baseline", "merged", "shared", "both"]
    assert rows["baseline"]["ratio"] == 1.0
    for row in rows.values():
        assert row["tokens_per_s"] > 0
        assert row["same_tokens"], row
        assert row["max_dlogp"] < 1e-4, row
