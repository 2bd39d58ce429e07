"""BFCL's own scorer against ToolCall-v0's grades, item by item (issue #25, part 3).

    .venv/bin/python -m benchmarks.bfcl_agreement [--tasks bfcl_single_turn] [--limit N]
        [--out DIR]

For each BFCL single-turn item of the task sets it plays ToolCall-v0 episodes with several
answers: the reference answer (the env's reference agent, from the item's ground truth)
and deliberate mistakes made from it (a wrong function name, a wrong argument value, a
required argument left out, an extra argument, a value of the wrong type, arguments that
are not JSON, no call at all, or, where no call is the answer, a call). Each answer's
assistant message is written by the leaderboard's exporter (`exports.bfcl_line`: the line
BFCL's OpenAI function-calling handler writes, `[{name: arguments' JSON text}]` or the
reply's text), one result file per category and answer kind, and BFCL's
`eval_runner.evaluate_task` scores the file as `bfcl evaluate` does: BFCL's loaders, its
handler's `decode_ast`, its `ast_checker` and relevance rules, its score file. The table
compares its verdict on each line with the env's; the exit status is 1 on any disagreement.

bfcl-eval's `eval_runner` imports `bfcl_eval.constants.model_config`, which imports a
handler, and so an SDK, for every provider BFCL evaluates. `scorer()` imports the runner
with a one-entry stand-in for that module holding BFCL's own entry for the graded model
(`envs.toolcall.bfcl.GRADED_AS`: handler `OpenAIResponsesHandler`, function calling,
`underscore_to_dot`), as `envs.toolcall.bfcl` does for the checker. The runner's other
imports need `overrides` and `tree_sitter` 0.21.3 with its Java and JavaScript grammars.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib
import io
import json
import logging
import os
import sys
import tempfile
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.leaderboard.exports import bfcl_line
from envs.core import Message, tool_calls_message
from envs.toolcall import bfcl
from envs.toolcall.env import ToolCallEnv
from envs.toolcall.tasks import ToolCallTask

logger = logging.getLogger(__name__)

Calls = list[tuple[str, dict[str, Any]]]
NO_CALL: Message = {"role": "assistant", "content": "None of these functions fits the request."}
EXTRA_ARGUMENT = "unexpected_argument"


@dataclass(frozen=True)
class Verdict:
    """Both graders' verdicts on one answer to one item.

    Attributes:
        item_id: the BFCL item id.
        category: its BFCL category.
        variant: which answer: "reference" or the mistake made from it.
        toolcall_valid: ToolCall-v0's verdict (reward 1).
        toolcall_error: the env's error type ("" when valid).
        bfcl_valid: the verdict of BFCL's scorer on the exported result line.
        bfcl_error: its error type ("" when valid).
    """

    item_id: str
    category: str
    variant: str
    toolcall_valid: bool
    toolcall_error: str
    bfcl_valid: bool
    bfcl_error: str

    @property
    def agree(self) -> bool:
        return self.toolcall_valid == self.bfcl_valid


# -- answers -----------------------------------------------------------------------------
def _other_value(value: Any) -> Any:
    """A value of the same type that no ground truth lists beside `value`."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return f"{value}_wrong"
    if isinstance(value, list):
        return [*value, *value[:1]] if value else ["wrong"]
    if isinstance(value, dict):
        return {**value, "wrong_key": "wrong"}
    return "wrong"


def _other_type(value: Any) -> Any:
    """The value as another JSON type: text as a number, anything else as its text."""
    if isinstance(value, str):
        return 12345
    return json.dumps(value)


def _edit_first(calls: Calls, edit: Callable[[dict[str, Any]], bool]) -> Calls | None:
    """`calls` with the first call's arguments edited in place by `edit`, or None where
    `edit` finds nothing to change."""
    if not calls:
        return None
    name, arguments = calls[0]
    changed = dict(arguments)
    if not edit(changed):
        return None
    return [(name, changed), *calls[1:]]


def _change_first_value(how: Callable[[Any], Any]) -> Callable[[dict[str, Any]], bool]:
    def edit(arguments: dict[str, Any]) -> bool:
        if not arguments:
            return False
        key = next(iter(arguments))
        arguments[key] = how(arguments[key])
        return True

    return edit


def variants(task: ToolCallTask) -> dict[str, Message]:
    """The answers played on one BFCL single-turn item, by name: the reference answer and
    each mistake that applies to it (an argument edit needs an argument to edit)."""
    calls = bfcl.reference_calls(task.data, task.category)
    if not calls:
        docs = task.data["function"]
        first = bfcl.tool_name(docs[0]["name"]) if docs else "made_up_function"
        spurious = tool_calls_message([(first, {})])
        return {"reference": NO_CALL, "spurious_call": spurious}
    required = {
        bfcl.tool_name(doc["name"]): set(doc["parameters"].get("required", []))
        for doc in task.data["function"]
    }

    def drop_required(arguments: dict[str, Any]) -> bool:
        names = required.get(calls[0][0], set())
        key = next((k for k in arguments if k in names), None)
        if key is None:
            return False
        del arguments[key]
        return True

    def add_extra(arguments: dict[str, Any]) -> bool:
        arguments[EXTRA_ARGUMENT] = "x"
        return True

    mistakes: dict[str, Calls | None] = {
        "wrong_function": [(f"{calls[0][0]}_wrong", calls[0][1]), *calls[1:]],
        "wrong_value": _edit_first(calls, _change_first_value(_other_value)),
        "missing_required": _edit_first(calls, drop_required),
        "extra_argument": _edit_first(calls, add_extra),
        "wrong_type": _edit_first(calls, _change_first_value(_other_type)),
    }
    answers: dict[str, Message] = {"reference": tool_calls_message(calls)}
    answers |= {name: tool_calls_message(c) for name, c in mistakes.items() if c is not None}
    broken = tool_calls_message([(calls[0][0], "{not json")])
    return answers | {"broken_arguments": broken, "no_call": NO_CALL}


def play(env: ToolCallEnv, task_id: str, answer: Message) -> tuple[bool, str]:
    """ToolCall-v0's verdict on one answer: one episode, its grade at the end."""
    env.reset(options={"task_id": task_id})
    _, reward, terminated, _, info = env.step(copy.deepcopy(answer))
    if not terminated:
        raise RuntimeError(f"the episode of {task_id} did not end after its answer")
    valid = reward > 0  # BFCL's checker names an error type even for a valid call
    return valid, "" if valid else str(info.get("grade", {}).get("error_type", ""))


# -- BFCL's scorer -----------------------------------------------------------------------
@functools.cache
def scorer() -> types.ModuleType:
    """bfcl-eval's `eval_runner`, imported with a one-entry model registry (see above)."""
    name = "bfcl_eval.constants.model_config"
    if name in sys.modules:
        return importlib.import_module("bfcl_eval.eval_checker.eval_runner")
    handler = importlib.import_module("bfcl_eval.model_handler.api_inference.openai_response")
    stand_in = types.ModuleType(name)
    stand_in.__doc__ = "clawgym's one-entry stand-in, present only while the runner imports"
    stand_in.MODEL_CONFIG_MAPPING = {  # type: ignore[attr-defined]
        bfcl.GRADED_AS: types.SimpleNamespace(
            model_name=bfcl.GRADED_AS.removesuffix("-FC"),
            model_handler=handler.OpenAIResponsesHandler,
            is_fc_model=True,
            underscore_to_dot=True,
        )
    }
    bfcl._ast_checker_module()  # the checker first, bound to its own stand-in's mapping
    sys.modules[name] = stand_in
    try:
        return importlib.import_module("bfcl_eval.eval_checker.eval_runner")
    finally:
        if sys.modules.get(name) is stand_in:
            del sys.modules[name]


@contextlib.contextmanager
def _api_key_for_construction() -> Iterator[None]:
    """The handler builds an OpenAI client, which wants a key; scoring never calls it."""
    had = "OPENAI_API_KEY" in os.environ
    if not had:
        os.environ["OPENAI_API_KEY"] = "unused-scoring-only"
    try:
        yield
    finally:
        if not had:
            del os.environ["OPENAI_API_KEY"]


def bfcl_score(result_file: Path, category: str, score_dir: Path) -> dict[str, tuple[bool, str]]:
    """BFCL's verdicts on a result file of one category, by item id: `evaluate_task`, as
    `bfcl evaluate --partial-eval` runs it, then its score file read back."""
    runner = scorer()
    with _api_key_for_construction():
        handler = runner.get_handler(bfcl.GRADED_AS)
    lines = runner.load_file(result_file, sort_by_id=True)
    with contextlib.redirect_stdout(io.StringIO()):  # BFCL reports progress on stdout
        runner.evaluate_task(
            category, result_file.parent, score_dir, lines, bfcl.GRADED_AS, handler, {}, True
        )
    folder = score_dir / bfcl.GRADED_AS / runner.get_directory_structure_by_category(category)
    header, *failures = runner.load_file(folder / f"{runner.VERSION_PREFIX}_{category}_score.json")
    if header["total_count"] != len(lines):
        raise RuntimeError(f"BFCL scored {header['total_count']} of {len(lines)} lines")
    verdicts = {line["id"]: (True, "") for line in lines}
    verdicts |= {f["id"]: (False, str(f.get("error_type", ""))) for f in failures}
    return verdicts


# -- the comparison ----------------------------------------------------------------------
def compare(
    tasks: str | Sequence[str] = "bfcl_single_turn",
    limit: int | None = None,
    out: Path | None = None,
) -> list[Verdict]:
    """Both graders' verdicts on every answer to the first `limit` items (None: all) of each
    single-turn category in `tasks`; result and score files go under `out` (None: a
    temporary folder)."""
    with contextlib.ExitStack() as stack:
        if out is None:
            out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bfcl-agree-")))
        env = stack.enter_context(contextlib.closing(ToolCallEnv(tasks=tasks, split="all")))
        by_category: dict[str, list[ToolCallTask]] = {}
        for task in env.tasks.values():
            if task.kind == "bfcl_single":
                by_category.setdefault(task.category, []).append(task)
        verdicts: list[Verdict] = []
        for category, items in by_category.items():
            verdicts += _compare_category(env, category, items[:limit], out)
        return verdicts


def _compare_category(
    env: ToolCallEnv, category: str, items: Sequence[ToolCallTask], out: Path
) -> list[Verdict]:
    played: dict[str, list[tuple[str, Message, bool, str]]] = {}
    for task in items:
        for variant, answer in variants(task).items():
            valid, error = play(env, task.task_id, answer)
            played.setdefault(variant, []).append((task.data["id"], answer, valid, error))
    verdicts = []
    for variant, rows in played.items():
        folder = out / "result" / variant / bfcl.GRADED_AS
        folder.mkdir(parents=True, exist_ok=True)
        result_file = folder / f"BFCL_v4_{category}_result.json"
        lines = [json.dumps(bfcl_line(item_id, answer)) for item_id, answer, _, _ in rows]
        result_file.write_text("\n".join(lines) + "\n")
        scored = bfcl_score(result_file, category, out / "score" / variant)
        for item_id, _, valid, error in rows:
            bfcl_valid, bfcl_error = scored[item_id]
            verdicts.append(
                Verdict(item_id, category, variant, valid, error, bfcl_valid, bfcl_error)
            )
    logger.info("%s: %d items, %d answers", category, len(items), len(verdicts))
    return verdicts


def report(verdicts: Sequence[Verdict]) -> str:
    """The agreement table: per category and answer kind, then every disagreement."""
    lines = [f"{'category':<24}{'variant':<18}{'answers':>8}{'agree':>8}{'bfcl ok':>9}"]
    groups: dict[tuple[str, str], list[Verdict]] = {}
    for verdict in verdicts:
        groups.setdefault((verdict.category, verdict.variant), []).append(verdict)
    for (category, variant), group in groups.items():
        agree = sum(v.agree for v in group)
        accepted = sum(v.bfcl_valid for v in group)
        lines.append(f"{category:<24}{variant:<18}{len(group):>8}{agree:>8}{accepted:>9}")
    items = len({v.item_id for v in verdicts})
    agreeing = sum(v.agree for v in verdicts)
    lines.append(f"items {items}, answers {len(verdicts)}, agreement {agreeing}/{len(verdicts)}")
    for v in verdicts:
        if not v.agree:
            lines.append(
                f"DISAGREE {v.item_id} [{v.variant}] toolcall={v.toolcall_valid} "
                f"({v.toolcall_error or 'valid'}) bfcl={v.bfcl_valid} ({v.bfcl_error or 'valid'})"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="bfcl_single_turn", help="ToolCall-v0 task sets")
    parser.add_argument("--limit", type=int, default=None, help="items per category")
    parser.add_argument("--out", type=Path, default=None, help="keep result / score files")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    verdicts = compare(args.tasks, args.limit, args.out)
    sys.stdout.write(report(verdicts) + "\n")
    return 0 if all(v.agree for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
