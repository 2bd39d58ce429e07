"""`python -m trainers.run env=swe method=binary`: grouped rollouts on SWE tasks, scored by
the env's outcome, through the same pipeline and store as the chat env (tiny model)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agents.store import Store
from agents.trajectory import TurnStatus

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("engine", "steps"),
    [("embedded", 2), pytest.param("vllm", 1, marks=pytest.mark.vllm)],
)
def test_binary_training_on_swe_finishes_its_steps(tmp_path, engine, steps):
    run_dir = tmp_path / "swe"
    command = [
        sys.executable,
        "-m",
        "trainers.run",
        "env=swe",
        "method=binary",
        "judge=self",
        "sft.warm_start_steps=0",
        "eval.episodes=0",
        "model=tiny",
        f"engine={engine}",
        "engine.max_lora_rank=8",
        f"trainer.max_steps={steps}",
        # small enough for a 2-core CPU: two-turn episodes in bwrap, short replies
        "env.swe.kwargs.max_turns=2",
        "env.swe.kwargs.sandbox=bwrap",
        "env.swe.max_tokens=8",
        "judge.max_tokens=16",
        "trainer.batch_turns=2",
        "trainer.lora_rank=4",
        f"run_dir={run_dir}",
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["method"], summary["steps"], summary["adapter_version"]) == (
        "binary",
        steps,
        steps,
    )
    assert summary["engine"] == engine
    assert (run_dir / "adapters" / f"v{steps}" / "adapter_model.safetensors").exists()
    with Store(run_dir / "store.sqlite") as store:
        sessions = [s for s in store.sessions() if s.outcome_reward is not None]
        assert sessions and all(s.env_id == "swe" for s in sessions)  # its name in the run
        # a tiny random model resolves nothing: every finished episode is graded -1
        assert {s.outcome_reward for s in sessions} == {-1.0}
        groups = {s.group_id for s in sessions}
        assert len(groups) < len(sessions)  # rollouts of one task share a group
        assert store.count_turns(TurnStatus.TRAINED) == summary["turns_trained"] >= 2
