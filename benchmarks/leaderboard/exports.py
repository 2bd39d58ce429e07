"""Exporters: a task set's episodes in the formats the field's own tools read, so that a
number here can be checked by the tool that defines it on the public leaderboards.

A task set names its exporter (`TaskSet.exporter`); `benchmarks.run` calls it after each
policy's episodes with `(directory, result, episodes, trajectories)`.

- `swe_predictions`: SWE-bench's predictions file (`instance_id`, `model_name_or_path`,
  `model_patch`, one JSON object a line), ready for `swebench.harness.run_evaluation`,
  from the `info["model_patch"]` that `clawgym/SWE-v0` reports at the episode's end.
- `bfcl_results`: BFCL's result lines (`id`, `result`: the first reply's calls as BFCL's
  OpenAI function-calling handler writes them, `[{name: arguments' JSON text}]`, or the
  reply's text), for `bfcl evaluate`. The ToolCall env already grades single-turn items
  with bfcl-eval's own AST checker, so its success rate is BFCL's accuracy on the same
  items; the file lets BFCL's scorer re-score it (`python -m benchmarks.bfcl_agreement`
  compares the two item by item).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agents.store import Store
from benchmarks.leaderboard.evaluate import EpisodeRecord, TaskSetResult


def _target(directory: Path, result: TaskSetResult, suffix: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.@-]+", "_", f"{result.task_set}__{result.policy}")
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"{safe}.{suffix}"


def _write_lines(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def swe_predictions(
    directory: Path, result: TaskSetResult, episodes: Sequence[EpisodeRecord], _: Store
) -> Path:
    """SWE-bench predictions (JSONL) of one policy on one task set; returns the file."""
    rows = []
    for episode in episodes:
        info = json.loads(episode.info)
        rows.append(
            {
                "instance_id": episode.task_id.split("/", 1)[-1],
                "model_name_or_path": result.policy,
                "model_patch": info.get("model_patch") or info.get("patch") or "",
            }
        )
    return _write_lines(_target(directory, result, "predictions.jsonl"), rows)


def bfcl_results(
    directory: Path,
    result: TaskSetResult,
    episodes: Sequence[EpisodeRecord],
    trajectories: Store,
) -> Path:
    """BFCL result lines of one policy on one task set, from each episode's first reply."""
    rows = []
    for episode in episodes:
        turns = trajectories.session(episode.session_id).turns if episode.session_id else ()
        reply = turns[0].completion if turns else {}
        rows.append(bfcl_line(episode.task_id.removeprefix("bfcl/"), reply))
    return _write_lines(_target(directory, result, "bfcl_result.jsonl"), rows)


def bfcl_line(item_id: str, reply: Mapping[str, Any]) -> dict[str, Any]:
    """One reply as the line BFCL's OpenAI function-calling handler writes: each call as
    `{name: arguments}`, the arguments' JSON text as the API returned it (BFCL's
    `decode_ast` parses that text itself); a reply without calls as its text."""
    calls = reply.get("tool_calls") or []
    if not calls:
        return {"id": item_id, "result": reply.get("content") or ""}
    functions = [call.get("function") or {} for call in calls]
    return {
        "id": item_id,
        "result": [{f.get("name"): _json_text(f.get("arguments"))} for f in functions],
    }


def _json_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)
