"""Runs BFCL's multi-turn backends inside the sandbox: the `__main__` of the bundle that
`envs.toolcall.multiturn` copies in (with the backends' sources and mpmath).

It imports only the standard library and bfcl-eval's multi-turn modules, never clawgym.
It reads one JSON request from the file named by its argument and writes one JSON answer:

- `{"op": "execute", "entry": {...}, "history": [[call, ...], ...], "calls": [call, ...]}`:
  replays `history` (every earlier step of the episode) on fresh backends, then executes
  `calls`; answers `{"results": [str, ...]}`. Replaying keeps no process alive between
  steps, so a call that hangs or crashes costs one step, never the episode's state.
- `{"op": "grade", "entry": {...}, "decoded": [[[call, ...], ...], ...], "ground_truth": [...]}`:
  BFCL's `multi_turn_checker` on the episode's calls; answers `{"valid", "error_type",
  "error_message"}`.
"""

import contextlib
import io
import json
import sys

MODEL_NAME = "clawgym"


def _long_context(entry):
    category = entry["id"].rsplit("_", 1)[0]
    return "long_context" in category or "composite" in category


def execute(request):
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import (
        execute_multi_turn_func_call,
    )

    entry = request["entry"]
    results = []
    for calls in [*request["history"], request["calls"]]:
        results, _ = execute_multi_turn_func_call(
            func_call_list=calls,
            initial_config=entry["initial_config"],
            involved_classes=entry["involved_classes"],
            model_name=MODEL_NAME,
            test_entry_id=entry["id"],
            long_context=_long_context(entry),
        )
    return {"results": results}


def grade(request):
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    entry = request["entry"]
    category = entry["id"].rsplit("_", 1)[0]
    try:
        result = multi_turn_checker(
            request["decoded"], request["ground_truth"], entry, category, MODEL_NAME
        )
    except Exception as error:  # BFCL asserts on mismatched instances: a failed check
        return {
            "valid": False,
            "error_type": "multi_turn:checker_error",
            "error_message": str(error),
        }
    return {
        "valid": bool(result.get("valid")),
        "error_type": str(result.get("error_type", "")),
        "error_message": str(result.get("error_message", "")),
    }


def main(argv):
    with open(argv[1], encoding="utf-8") as file:
        request = json.load(file)
    # The backends may print; only the answer goes to stdout.
    with contextlib.redirect_stdout(io.StringIO()):
        answer = execute(request) if request["op"] == "execute" else grade(request)
    sys.stdout.write(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
