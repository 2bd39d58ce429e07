"""The leaderboard end to end on real environments, engines and SQLite: policy specs,
suites, the baselines' ranking, adapters by step, the proxy path and the CLI."""

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.leaderboard.config import BenchConfig, SamplingConfig, policy_specs, validate
from benchmarks.leaderboard.policies import parse_policy
from benchmarks.leaderboard.suites import (
    FAMILIES,
    TASK_SETS,
    EpisodeTrace,
    TaskSet,
    chat_outcome,
    suite,
)
from benchmarks.run import benchmark

ROOT = Path(__file__).resolve().parents[2]


def make_run(run_dir: Path, steps=(1, 2)) -> Path:
    """A training run directory as `trainers.run` leaves it (config.yaml, adapters/v<N>) with
    LoRA adapters on `tiny` whose B matrices are random, so every step is a different policy
    (training one for real takes minutes here; `tests/trainers/test_run.py` does that)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from agents import models

    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("model:\n  name: tiny\n")
    base, _ = models.load("tiny")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(0)
    for step in steps:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
        model.save_pretrained(run_dir / "adapters" / f"v{step}")
    return run_dir


def config(tmp_path: Path, **changes) -> BenchConfig:
    fields = {"out_dir": str(tmp_path / "out"), "policy": []}
    return BenchConfig(**(fields | changes))


# -- specs, suites, config -----------------------------------------------------------------
def test_policy_specs_cover_every_form_and_reject_malformed_ones(tmp_path):
    assert [s.kind for s in parse_policy("do-nothing") + parse_policy("oracle")] == [
        "scripted",
        "scripted",
    ]
    (model,) = parse_policy("tiny")
    assert (model.kind, model.name, model.engine) == ("model", "tiny", "embedded")
    assert parse_policy("vllm:smollm2-135m")[0].engine == "vllm"
    (remote,) = parse_policy("openai:gpt-x@http://127.0.0.1:9/v1")
    assert (remote.kind, remote.name, remote.base_url) == (
        "endpoint",
        "gpt-x",
        "http://127.0.0.1:9/v1",
    )
    with pytest.raises(ValueError, match="openai:MODEL@"):
        parse_policy("openai:gpt-x")
    with pytest.raises(ValueError, match="no adapters"):
        parse_policy(f"adapter:{tmp_path}")
    with pytest.raises(ValueError, match="engine"):
        parse_policy("tiny", engine="tpu")


def test_adapter_specs_pick_steps_and_the_base_model_starts_the_curve(tmp_path):
    run = tmp_path / "myrun"
    for step in (1, 3):
        (run / "adapters" / f"v{step}").mkdir(parents=True)
    (run / "config.yaml").write_text("model:\n  name: tiny\n")
    every = parse_policy(f"adapter:{run}@all")
    assert [(s.label, s.kind, s.step) for s in every] == [
        ("myrun@0", "model", 0),
        ("myrun@1", "adapter", 1),
        ("myrun@3", "adapter", 3),
    ]
    assert {s.series for s in every} == {"myrun"} and {s.name for s in every} == {"tiny"}
    assert parse_policy(f"adapter:{run}")[0].step == 3  # latest by default
    assert parse_policy(f"adapter:{run}@1")[0].adapter_dir == str(run / "adapters" / "v1")
    with pytest.raises(ValueError, match="step '2' not in"):
        parse_policy(f"adapter:{run}@2")


def test_suites_are_held_out_registered_and_named_by_their_tasks():
    full = [t.name for t in suite("full")]
    assert full == [name for family in FAMILIES.values() for name in family]
    assert all(t.kwargs.get("split") == "test" for t in suite("full"))
    smoke = suite("smoke")
    assert all(t.name.startswith("smoke/") and t.limit for t in smoke)
    assert [t.name for t in suite("arith", limit=5)] == ["arith/test[5]"]
    with pytest.raises(ValueError, match="unknown suite"):
        suite("nope")
    spread = TaskSet("x", "clawgym/Arith-v0", limit=3).select([f"t{i}" for i in range(9)])
    assert spread == ["t0", "t3", "t6"]  # evenly spaced, not a prefix
    # a task set's oracle solves all of it, so GUI's held-out split is cut where solvers end
    assert TASK_SETS["gui/test-scripted"].oracle and TASK_SETS["gui/test-other"].oracle is None


def test_validate_says_the_fix(tmp_path):
    with pytest.raises(ValueError, match="sampling.temperature"):
        validate(config(tmp_path, samples=4))
    with pytest.raises(ValueError, match="suite="):
        validate(config(tmp_path, suite="everything"))
    with pytest.raises(ValueError, match="serve=direct"):
        validate(config(tmp_path, serve="grpc"))
    labels = [s.label for s in policy_specs(config(tmp_path, policy=["tiny", "oracle", "tiny"]))]
    assert labels == ["do-nothing", "oracle", "tiny"]  # baselines first, each once


def test_chat_success_needs_every_question_satisfied():
    def trace(*verdicts, terminated=True):
        infos = [{}] + [
            {"user_verdict": v, "preference_score": 1.0 if v == "satisfied" else 0.0}
            for v in verdicts
        ]
        return EpisodeTrace("t", (0.0,) * len(verdicts), tuple(infos), terminated, False)

    assert chat_outcome(trace("satisfied", "satisfied")).success
    assert chat_outcome(trace("correction", "satisfied")).score == 0.5
    assert not chat_outcome(trace("gave_up", "satisfied")).success
    assert not chat_outcome(trace("satisfied", terminated=False)).success


def test_swe_predictions_are_in_swe_bench_format(tmp_path):
    from benchmarks.leaderboard.evaluate import EpisodeRecord
    from benchmarks.leaderboard.exports import swe_predictions

    episode = EpisodeRecord(
        "swe/astropy__astropy-1",
        0,
        7,
        True,
        1.0,
        1.0,
        3,
        0,
        0,
        0.1,
        None,
        None,
        json.dumps({"model_patch": "diff --git a/x b/x"}),
    )
    result = type("R", (), {"task_set": "swe/test", "policy": "tiny"})()
    path = swe_predictions(tmp_path, result, [episode], None)
    assert json.loads(path.read_text()) == {
        "instance_id": "astropy__astropy-1",
        "model_name_or_path": "tiny",
        "model_patch": "diff --git a/x b/x",
    }


# -- end to end ----------------------------------------------------------------------------
def assert_ranked(rows):
    """Oracle first wherever there is one, do-nothing last (ties allowed), in every set."""
    by_set: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_set.setdefault(row.task_set, {})[row.policy] = row
    for task_set, policies in by_set.items():
        idle = policies["do-nothing"]
        for name, row in policies.items():
            assert (idle.pass1, idle.score) <= (row.pass1, row.score), (task_set, name)
        if "oracle" in policies:
            oracle = policies["oracle"]
            assert oracle.pass1 == 1.0 and oracle.errors == 0, task_set
            for name, row in policies.items():
                assert (row.pass1, row.score) <= (oracle.pass1, oracle.score), (task_set, name)
            assert oracle.pass1 > idle.pass1, task_set
    return by_set


@pytest.mark.browser
def test_oracle_tops_and_do_nothing_trails_every_smoke_task_set(tmp_path):
    run = benchmark(config(tmp_path, suite="smoke"))
    by_set = assert_ranked(run.results)
    assert set(by_set) == {t.name for t in suite("smoke")}
    assert all("oracle" in p for p in by_set.values())  # every smoke set has a reference agent
    with sqlite3.connect(run.store) as db:
        (saved,) = db.execute("SELECT config FROM runs").fetchone()
        assert json.loads(saved)["suite"] == "smoke"
        rows = db.execute("SELECT policy, task_ids, seeds, weights_hash FROM results").fetchall()
        assert len(rows) == len(run.results) == 2 * len(by_set)
        for _, ids, seeds, digest in rows:
            assert json.loads(ids) and len(json.loads(seeds)) >= len(json.loads(ids))
            assert len(digest) == 16
        hashes = {p: d for p, _, _, d in rows}
        assert hashes["do-nothing"] != hashes["oracle"]
    (bfcl,) = (tmp_path / "out" / "exports").glob("*/smoke_toolcall__oracle.bfcl_result.jsonl")
    lines = [json.loads(line) for line in bfcl.read_text().splitlines()]
    assert len(lines) == 3 and all(set(line) == {"id", "result"} for line in lines)
    (swe,) = (tmp_path / "out" / "exports").glob("*/smoke_swe__oracle.predictions.jsonl")
    (prediction,) = [json.loads(line) for line in swe.read_text().splitlines()]
    assert prediction["model_patch"].startswith("diff --git")
    text = run.markdown.read_text()
    assert "## suite `smoke`" in text and "| 1 | oracle |" in text
    assert "<svg" in run.html.read_text()


def test_adapters_by_step_are_distinct_policies_on_a_learning_curve(tmp_path):
    run_dir = make_run(tmp_path / "run")
    run = benchmark(
        config(
            tmp_path,
            suite="arith/test",
            limit=2,
            baselines=[],
            policy=[f"adapter:{run_dir}@all"],
            sampling=SamplingConfig(max_tokens=8),
        )
    )
    assert [(r.policy, r.step, r.kind) for r in run.results] == [
        ("run@0", 0, "model"),
        ("run@1", 1, "adapter"),
        ("run@2", 2, "adapter"),
    ]
    assert len({r.weights_hash for r in run.results}) == 3
    assert all(r.tokens_in > 0 and r.tokens_out > 0 and r.errors == 0 for r in run.results)
    assert "data-plot='curve'" in run.html.read_text()


def test_a_model_plays_through_the_proxy_with_token_counts(tmp_path):
    run = benchmark(
        config(
            tmp_path,
            suite="arith/test",
            limit=1,
            baselines=[],
            policy=["tiny"],
            serve="proxy",
            sampling=SamplingConfig(max_tokens=4),
        )
    )
    (result,) = run.results
    assert result.errors == 0 and result.turns == 6 and result.tokens_out == 24
    (proxy_store,) = (tmp_path / "out" / "proxy").glob("*.sqlite")
    with sqlite3.connect(proxy_store) as db:
        assert db.execute("SELECT COUNT(*) FROM turns").fetchone()[0] == 6


@pytest.mark.slow
@pytest.mark.browser
def test_smoke_suite_with_tiny_from_the_command_line_writes_everything(tmp_path):
    out = tmp_path / "out"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "suite=smoke", "policy=tiny", f"out_dir={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert time.monotonic() - started < 300
    assert {"results.sqlite", "leaderboard.md", "index.html"} <= {p.name for p in out.iterdir()}
    with sqlite3.connect(out / "results.sqlite") as db:
        policies = {p for (p,) in db.execute("SELECT DISTINCT policy FROM results")}
    assert policies == {"tiny", "oracle", "do-nothing"}


@pytest.mark.browser
def test_a_vision_language_policy_plays_gui_on_screenshots(tmp_path):
    """`suite=gui/test-screenshot policy=tiny-vl`: the held-out GUI tasks seen as screenshots
    alone, played by the VL model through the pixel tools, and kept out of `suite=full`."""
    assert "gui/test-screenshot" not in [t.name for t in suite("full")]
    run = benchmark(config(tmp_path, suite="gui/test-screenshot", policy="tiny-vl", limit=1))
    rows = {row.policy: row for row in run.results}
    assert set(rows) == {"do-nothing", "tiny-vl"}  # no oracle acts on pixels
    played = rows["tiny-vl"]
    assert played.task_set == "gui/test-screenshot[1]" and played.errors == 0
    with sqlite3.connect(run.store) as db:
        (config_text,) = db.execute("SELECT config FROM runs").fetchone()
    assert json.loads(config_text)["suite"] == "gui/test-screenshot"
