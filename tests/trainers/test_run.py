import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from agents.store import Store
from trainers.config import RunConfig, validate

ROOT = Path(__file__).resolve().parents[2]


def test_main_job_runs_end_to_end_on_tiny(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainers.run",
            "model=tiny",
            "env.episodes=3",
            "env.group_size=2",
            "sampling.max_tokens=12",
            f"run_dir={run_dir}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["episodes"] == 3
    with Store(run_dir / "store.sqlite") as store:
        sessions = store.sessions()
        assert len(sessions) == 3
        assert [s.group_id for s in sessions] == ["group-0", "group-0", "group-2"]
        assert store.count_turns() == summary["turns"] > 0
    exported = datasets.Dataset.from_parquet(str(run_dir / "turns.parquet"))
    assert len(exported) == summary["turns"]
    assert "model:\n  name: tiny" in (run_dir / "config.yaml").read_text()


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda c: setattr(c.env, "episodes", 0), "env.episodes"),
        (lambda c: setattr(c.env, "group_size", 0), "env.group_size"),
        (lambda c: setattr(c.engine, "backend", "tgi"), "engine=embedded"),
        (lambda c: setattr(c.env, "id", "CartPole-v1"), "clawgym/"),
    ],
)
def test_bad_config_values_say_the_fix(change, fragment):
    config = RunConfig()
    change(config)
    with pytest.raises(ValueError, match=fragment):
        validate(config)
