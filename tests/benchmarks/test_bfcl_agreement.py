"""BFCL's own scorer (bfcl-eval's `eval_runner`) against ToolCall-v0's grades."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("bfcl_eval")

from benchmarks import bfcl_agreement as agreement  # noqa: E402
from benchmarks.leaderboard.exports import bfcl_line  # noqa: E402
from envs.toolcall import bfcl  # noqa: E402
from envs.toolcall.env import ToolCallEnv  # noqa: E402

# A call is all the relevance category asks for: a call to an unknown function, or with an
# argument too many, is a pass for both graders.
CALLS_THAT_PASS = {("live_relevance", "wrong_function"), ("live_relevance", "extra_argument")}


def test_bfcl_scorer_agrees_with_toolcall_on_a_sample_of_every_category(tmp_path):
    verdicts = agreement.compare("bfcl_single_turn", limit=2, out=tmp_path)
    assert {v.category for v in verdicts} == set(bfcl.SINGLE_TURN)
    disagreements = [v for v in verdicts if not v.agree]
    assert not disagreements, disagreements
    for v in verdicts:
        expected = v.variant == "reference" or (v.category, v.variant) in CALLS_THAT_PASS
        assert v.bfcl_valid == expected, v
    variants = {v.variant for v in verdicts}
    assert {"wrong_function", "wrong_value", "missing_required", "extra_argument"} <= variants
    assert {"wrong_type", "broken_arguments", "no_call", "spurious_call"} <= variants
    # BFCL's scorer wrote its own score file for each result file it read
    assert list((tmp_path / "score" / "wrong_type").rglob("BFCL_v4_simple_python_score.json"))


def test_the_comparison_catches_a_result_file_bfcl_cannot_read(tmp_path):
    """Arguments written as JSON objects (not the API's JSON text, which BFCL's handler
    parses): the env still grades the reply, BFCL's scorer fails to decode it."""
    env = ToolCallEnv(tasks="simple_python", split="all")
    task = next(iter(env.tasks.values()))
    answer = agreement.variants(task)["reference"]
    assert agreement.play(env, task.task_id, answer) == (True, "")
    env.close()
    line = bfcl_line(task.data["id"], answer)
    line["result"] = [{n: json.loads(a)} for call in line["result"] for n, a in call.items()]
    folder = tmp_path / "result" / bfcl.GRADED_AS
    folder.mkdir(parents=True)
    result_file = folder / "BFCL_v4_simple_python_result.json"
    result_file.write_text(json.dumps(line) + "\n")
    scored = agreement.bfcl_score(result_file, "simple_python", tmp_path / "score")
    assert scored == {task.data["id"]: (False, "ast_decoder:decoder_failed")}


def test_exported_lines_decode_in_bfcl_handler_as_the_env_decodes_them():
    agreement.scorer()
    handler_module = sys.modules["bfcl_eval.model_handler.api_inference.openai_response"]
    with agreement._api_key_for_construction():
        handler = handler_module.OpenAIResponsesHandler(
            model_name="m", temperature=0, registry_name="m", is_fc_model=True
        )
    env = ToolCallEnv(tasks="parallel_multiple", split="all")
    for task in list(env.tasks.values())[:5]:
        answer = agreement.variants(task)["reference"]
        line = bfcl_line(task.data["id"], answer)
        decoded = handler.decode_ast(line["result"], "python", False)
        assert decoded == bfcl.decode_calls(answer["tool_calls"])
        assert len(decoded) == len(task.data["answer"])
    env.close()


def test_scorer_import_leaves_no_stand_in_and_no_provider_sdk():
    agreement.scorer()
    assert "bfcl_eval.constants.model_config" not in sys.modules
    assert not any(m.split(".")[0] in ("anthropic", "cohere", "mistralai") for m in sys.modules)


def test_command_prints_the_table_and_exits_zero_on_agreement(tmp_path, capsys):
    argv = ["--tasks", "simple_javascript", "--limit", "2", "--out", str(tmp_path)]
    assert agreement.main(argv) == 0
    out = capsys.readouterr().out
    assert "items 2, answers 16, agreement 16/16" in out
    assert "DISAGREE" not in out
    assert Path(tmp_path, "result", "reference", bfcl.GRADED_AS).is_dir()


def test_report_lists_every_disagreement():
    verdicts = [
        agreement.Verdict("a_1", "simple_python", "reference", True, "", True, ""),
        agreement.Verdict("a_2", "simple_python", "reference", True, "", False, "x:y"),
    ]
    text = agreement.report(verdicts)
    assert "agreement 1/2" in text
    assert "DISAGREE a_2 [reference] toolcall=True (valid) bfcl=False (x:y)" in text


def test_leaderboard_export_file_is_scored_by_bfcl_as_the_env_grades_it(tmp_path):
    """The exporter end to end: episodes' first replies in a real trajectory store,
    `exports.bfcl_results`, BFCL's scorer on the file it writes."""
    from agents.store import Store
    from agents.trajectory import Session, Turn, TurnType
    from benchmarks.leaderboard.evaluate import EpisodeRecord
    from benchmarks.leaderboard.exports import bfcl_results

    env = ToolCallEnv(tasks="multiple", split="all")
    store = Store(tmp_path / "trajectories.db")
    episodes, expected = [], {}
    for index, task in enumerate(list(env.tasks.values())[:6]):
        variant = ("reference", "wrong_value", "no_call")[index % 3]
        answer = agreement.variants(task)[variant]
        expected[task.data["id"]] = agreement.play(env, task.task_id, answer)[0]
        session_id = f"s{index}"
        store.add_session(Session(session_id, "clawgym/ToolCall-v0", task.task_id))
        store.add_turn(Turn(session_id, 0, TurnType.MAIN, (), (), (), (), answer, 0))
        record = (task.task_id, 0, 0, True, 1.0, 1.0, 1, 0, 0, 0.1, session_id, None)
        episodes.append(EpisodeRecord(*record))
    env.close()
    result = type("R", (), {"task_set": "toolcall/bfcl", "policy": "oracle"})()
    exported = bfcl_results(tmp_path / "exports", result, episodes, store)
    folder = tmp_path / "result" / bfcl.GRADED_AS
    folder.mkdir(parents=True)
    result_file = folder / "BFCL_v4_multiple_result.json"
    result_file.write_text(exported.read_text())
    scored = agreement.bfcl_score(result_file, "multiple", tmp_path / "score")
    assert {item: valid for item, (valid, _) in scored.items()} == expected
    assert sorted(expected.values()) == [False, False, False, False, True, True]
