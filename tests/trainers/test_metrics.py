"""metrics.jsonl as the run's durable record: on disk as each step's rows are written, and
made whole again on resume (`trainers.metrics` says the rule)."""

import json
import subprocess
import sys

from trainers.metrics import MetricsWriter, read_metrics, record

ROW = {"loss": 0.5, "turns": 2}


def _lines(run_dir):
    return [(r["step"], r.get("env")) for r in read_metrics(run_dir)]


def test_a_row_is_in_the_file_once_write_returns_though_the_process_is_then_killed(tmp_path):
    """The writer never holds rows back for a later flush or close: a writer killed with
    SIGKILL right after `write` returns has left that row."""
    script = (
        "import os, signal, sys\n"
        "from trainers.metrics import MetricsWriter\n"
        "writer = MetricsWriter(sys.argv[1])\n"
        "writer.write(1, {'loss': 0.5})\n"
        "writer.write(1, {'episodes': 3}, env='chat')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], timeout=300)
    assert done.returncode == -9
    assert read_metrics(tmp_path) == [
        {"step": 1, "loss": 0.5},
        {"step": 1, "env": "chat", "episodes": 3},
    ]


def test_resume_keeps_each_checkpointed_steps_records_once_and_drops_the_rest(tmp_path):
    """Resumed from step 2's checkpoint: the before evaluation (step 0) and steps 1-2 stay
    once (the checkpoint's copy of step 2 is not added again); step 3, which no checkpoint
    holds and the resumed run takes again, goes, and so does a line torn mid-write."""
    writer = MetricsWriter(tmp_path)
    writer.write(0, {"eval_pass_at_1": 0.25}, env="chat")
    step_two = [record(2, ROW), record(2, {"episodes": 4}, env="chat")]
    for step in (1, 2, 3):
        writer.write_records([record(step, ROW), record(step, {"episodes": 4}, env="chat")])
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 3, "env": "ch')

    kept = writer.resume(2, step_two)
    expected = [(0, "chat"), (1, None), (1, "chat"), (2, None), (2, "chat")]
    assert _lines(tmp_path) == [(r["step"], r.get("env")) for r in kept] == expected
    writer.write(3, ROW)  # the redone step 3, on a line of its own
    writer.close()
    assert _lines(tmp_path) == [*expected, (3, None)]


def test_resume_restores_a_checkpointed_step_that_the_kill_kept_from_the_file(tmp_path):
    """Killed between step 2's checkpoint and its rows' write: resume puts the checkpoint's
    copy in, once, however often the run resumes."""
    writer = MetricsWriter(tmp_path)
    writer.write(1, ROW)
    step_two = [record(2, ROW | {"loss": 0.25}), record(2, {"episodes": 4}, env="chat")]
    writer.resume(2, step_two)
    writer.resume(2, step_two)
    writer.close()
    assert read_metrics(tmp_path) == [{"step": 1, **ROW}, *step_two]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_resume_of_a_run_killed_before_its_first_checkpoint_keeps_only_the_before(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write(0, {"eval_pass_at_1": 0.25}, env="chat")
    writer.write(1, ROW)
    assert writer.resume(0, []) == [{"step": 0, "env": "chat", "eval_pass_at_1": 0.25}]
    writer.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {
        "step": 0,
        "env": "chat",
        "eval_pass_at_1": 0.25,
    }
