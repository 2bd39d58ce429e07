"""BFCL v4 from the installed `bfcl-eval` package: its items, their tools, and its checker.

This is the one module that imports bfcl-eval's code, and it imports only what grading
needs. The package's AST checker module imports `bfcl_eval.constants.model_config`, which
imports a handler, and so an SDK, for every provider BFCL evaluates (anthropic, cohere,
mistralai, google-genai, ...) only to read one flag of the model being graded:
`underscore_to_dot`, whether the model writes a "." of a function name as "_" (as every
OpenAI-compatible endpoint must). `_ast_checker_module` loads the checker with a one-entry
stand-in for that module in `sys.modules` for the duration of the import, then removes it:
the checker keeps its binding to the stand-in's mapping, and anyone importing the real
module later gets the real one. We grade as `GRADED_AS`, which has the same flag in
BFCL's own mapping, so the checker's verdicts are the same with either.

Single-turn items are graded as BFCL's `eval_runner` grades a function-calling model: the
reply's tool calls, decoded as `[{name: arguments}]`, go through `ast_checker`; for the
relevance categories only whether the reply holds a function call counts.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib
import importlib.util
import json
import sys
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# BFCL's model name for grading: an OpenAI function-calling model (`underscore_to_dot`).
GRADED_AS = "gpt-4o-2024-11-20-FC"

SINGLE_TURN = (
    "simple_python",
    "simple_java",
    "simple_javascript",
    "multiple",
    "parallel",
    "parallel_multiple",
    "irrelevance",
    "live_simple",
    "live_multiple",
    "live_parallel",
    "live_parallel_multiple",
    "live_irrelevance",
    "live_relevance",
)
MULTI_TURN = (
    "multi_turn_base",
    "multi_turn_miss_func",
    "multi_turn_miss_param",
    "multi_turn_long_context",
)
# The user message BFCL sends (to function-calling models) at a turn that adds functions.
ADDED_FUNCTIONS_PROMPT = "I have updated some more functions you can choose from. What about now?"

Decoded = list[dict[str, dict[str, Any]]]


@dataclass(frozen=True)
class Check:
    """BFCL's verdict on one reply."""

    valid: bool
    error_type: str = ""
    error: str = ""


# -- the package -------------------------------------------------------------------------
def package_root() -> Path:
    """The installed `bfcl_eval` package's directory (its data files live under it)."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "bfcl-eval is not installed; run scripts/setup.sh (it installs bfcl-eval==2026.3.23)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def _ast_checker_module() -> types.ModuleType:
    name = "bfcl_eval.constants.model_config"
    if name in sys.modules:
        return importlib.import_module("bfcl_eval.eval_checker.ast_eval.ast_checker")
    stand_in = types.ModuleType(name)
    stand_in.__doc__ = "clawgym's one-entry stand-in, present only while the checker imports"
    stand_in.MODEL_CONFIG_MAPPING = {  # type: ignore[attr-defined]
        GRADED_AS.replace("_", "/"): types.SimpleNamespace(underscore_to_dot=True)
    }
    sys.modules[name] = stand_in
    try:
        return importlib.import_module("bfcl_eval.eval_checker.ast_eval.ast_checker")
    finally:
        if sys.modules.get(name) is stand_in:
            del sys.modules[name]


def ast_checker(
    functions: Sequence[Mapping[str, Any]], decoded: Decoded, answer: Any, category: str
) -> dict[str, Any]:
    """BFCL's own `ast_checker`, called exactly as its `eval_runner` calls it."""
    module = _ast_checker_module()
    language = module.Language(_language(category))
    return dict(module.ast_checker(functions, decoded, answer, language, category, GRADED_AS))


def _language(category: str) -> str:
    return {"simple_java": "java", "simple_javascript": "javascript"}.get(category, "python")


@functools.cache
def _bfcl_utils() -> types.ModuleType:
    return importlib.import_module("bfcl_eval.utils")


# -- data --------------------------------------------------------------------------------
def _read_lines(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]


@functools.cache
def load_category(category: str) -> tuple[dict[str, Any], ...]:
    """Every item of a BFCL category, each with its ground truth under "answer" (None for
    the relevance categories, which have none), and, for multi-turn, its function docs."""
    if category not in SINGLE_TURN + MULTI_TURN:
        known = ", ".join(SINGLE_TURN + MULTI_TURN)
        raise ValueError(f"unknown BFCL category {category!r}; choose among {known}")
    data = package_root() / "data"
    items = _read_lines(data / f"BFCL_v4_{category}.json")
    answer_file = data / "possible_answer" / f"BFCL_v4_{category}.json"
    answers = (
        {a["id"]: a["ground_truth"] for a in _read_lines(answer_file)}
        if answer_file.exists()
        else {}
    )
    for item in items:
        item["answer"] = answers.get(item["id"])
        if category in MULTI_TURN:
            _attach_multi_turn_docs(item)
    return tuple(items)


def _attach_multi_turn_docs(item: dict[str, Any]) -> None:
    """Gives a multi-turn item its function docs, the held-out ones by turn, as BFCL does."""
    docs = [doc for name in item["involved_classes"] for doc in multi_turn_docs(name)]
    held_out: dict[str, list[dict[str, Any]]] = {}
    for turn, names in item.get("missed_function", {}).items():
        held_out[turn] = [doc for doc in docs if doc["name"] in names]
        docs = [doc for doc in docs if doc["name"] not in names]
    item["function"] = docs
    item["held_out"] = held_out


@functools.cache
def multi_turn_docs(class_name: str) -> tuple[dict[str, Any], ...]:
    """The function docs of one of BFCL's multi-turn backends (e.g. "GorillaFileSystem")."""
    mapping = importlib.import_module("bfcl_eval.constants.executable_backend_config")
    file = mapping.MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name]
    return tuple(_read_lines(package_root() / "data" / "multi_turn_func_doc" / file))


# -- tools -------------------------------------------------------------------------------
def tool_name(name: str) -> str:
    """A BFCL function name as a tool name: OpenAI's names allow no ".", BFCL writes "_"."""
    return name.replace(".", "_")


def tool_schema(doc: Mapping[str, Any], category: str) -> dict[str, Any]:
    """The JSON schema of a BFCL function doc's parameters, in OpenAI's types.

    Java and JavaScript arguments are source text, so every one of them is a string."""
    mapping = importlib.import_module("bfcl_eval.constants.type_mappings").GORILLA_TO_OPENAPI
    params = copy.deepcopy(dict(doc["parameters"]))
    language = _language(category)
    properties = params.get("properties", {})
    for prop in properties.values():
        if language != "python":
            kind = prop.get("type", "any")
            prop["type"] = "string"
            prop["description"] = (
                f"{prop.get('description', '')} (a {language} {kind} value, written as "
                f"{language} source text)"
            ).strip()
            prop.pop("items", None)
            prop.pop("properties", None)
        else:
            _to_openai_types(prop, mapping)
    return {
        "type": "object",
        "properties": properties,
        "required": list(params.get("required", [])),
    }


def _to_openai_types(schema: dict[str, Any], mapping: Mapping[str, str]) -> None:
    schema["type"] = mapping.get(schema.get("type", "string"), "string")
    for child in (schema.get("properties") or {}).values():
        _to_openai_types(child, mapping)
    if isinstance(schema.get("items"), dict):
        _to_openai_types(schema["items"], mapping)


# -- decoding and grading ----------------------------------------------------------------
def decode_calls(calls: Sequence[Mapping[str, Any]]) -> Decoded | None:
    """A reply's tool calls as BFCL's decoder for function-calling models returns them, or
    None where that decoder fails (arguments that are not a JSON object's text)."""
    decoded: Decoded = []
    for call in calls:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        try:
            values = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            return None
        if not isinstance(values, dict):
            return None
        decoded.append({str(function.get("name")): values})
    return decoded


def check_single_turn(item: Mapping[str, Any], category: str, decoded: Decoded | None) -> Check:
    """BFCL's verdict on a single-turn reply whose tool calls decoded to `decoded`."""
    utils = _bfcl_utils()
    if "relevance" in category:
        has_call = decoded is not None and not utils.is_empty_output(decoded)
        valid = not has_call if "irrelevance" in category else has_call
        return Check(valid, "" if valid else f"{category}:wrong_call_presence")
    if decoded is None:
        return Check(False, "ast_decoder:decoder_failed", "arguments are not a JSON object")
    if not utils.is_function_calling_format_output(decoded):
        return Check(False, "ast_decoder:decoder_wrong_output_format")
    result = ast_checker(item["function"], decoded, item["answer"], category)
    return Check(bool(result["valid"]), result.get("error_type", ""), str(result.get("error", "")))


# -- call strings (multi-turn) -----------------------------------------------------------
def call_string(name: str, arguments: Mapping[str, Any]) -> str:
    """A call as BFCL's executable decoder writes it: `name(k=repr(v),...)`."""
    return f"{name}({','.join(f'{key}={value!r}' for key, value in arguments.items())})"


def parse_call_string(text: str, docs: Sequence[Mapping[str, Any]]) -> tuple[str, dict[str, Any]]:
    """A ground-truth call string as (name, keyword arguments); positional arguments take
    the names of the function doc's parameters, in order."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain function call: {text!r}")
    name = node.func.id
    arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    if node.args:
        doc = next(d for d in docs if d["name"] == name)
        names = list(doc["parameters"].get("properties", {}))
        arguments = {n: ast.literal_eval(a) for n, a in zip(names, node.args, strict=False)} | (
            arguments
        )
    return name, arguments


# -- reference answers -------------------------------------------------------------------
def reference_calls(item: Mapping[str, Any], category: str) -> list[tuple[str, dict[str, Any]]]:
    """Tool calls (name, arguments) that BFCL's ground truth accepts: the first possible
    value of every argument ("" means the argument may be left out). For relevance items,
    a call to the first function with its first-listed values; for irrelevance, none."""
    if "irrelevance" in category:
        return []
    if category == "live_relevance":
        doc = item["function"][0]
        return [(tool_name(doc["name"]), {})]
    language = _language(category)
    docs = {doc["name"]: doc for doc in item["function"]}
    calls = []
    for ground_truth in item["answer"]:
        ((name, possible),) = ground_truth.items()
        parameters = docs[name]["parameters"]
        properties = parameters.get("properties", {})
        required = set(parameters.get("required", []))
        arguments = {}
        for arg, values in possible.items():
            chosen = [v for v in values if v != ""]
            if not chosen or ("" in values and arg not in required):
                continue  # "" among the possible values: the argument may be left out
            value = _first_choice(chosen[0])
            if language != "python":
                value = _source_text(value, properties.get(arg, {}), language)
            arguments[arg] = value
        calls.append((tool_name(name), arguments))
    return calls


def _first_choice(value: Any) -> Any:
    """A ground-truth value as a model would write it. BFCL lists the possible values of a
    dict's keys (one level deep, also for dicts in a list) the way it lists arguments'."""
    if isinstance(value, dict):
        return {
            key: options[0]
            for key, options in value.items()
            if isinstance(options, list) and options and "" not in options
        }
    if isinstance(value, list):
        return [_first_choice(v) if isinstance(v, dict) else v for v in value]
    return value


def _source_text(value: Any, prop: Mapping[str, Any], language: str) -> str:
    """A value written as the Java or JavaScript source BFCL's type converters read."""
    kind = prop.get("type", "any")
    if isinstance(value, str):
        return value  # BFCL's converters keep text they cannot parse as it is
    items = prop.get("items", {}).get("type", "")
    if language == "java":
        if kind == "long":
            return f"{value}L"
        if kind == "float":
            return f"{value}f"
        if kind == "ArrayList":
            return f"new ArrayList<>(Arrays.asList({_java_items(value, items)}))"
        if kind == "Array":
            element = _JAVA_ITEM.get(items, items or "Object")
            return f"new {element}[]{{{_java_items(value, items, quoted=False)}}}"
        if kind == "HashMap":
            puts = " ".join(f'put("{k}", {_java_value(v)});' for k, v in value.items())
            return f"new HashMap<String, Object>() {{{{ {puts} }}}}"
        return _java_value(value)
    if kind == "Bigint":
        return f"{value}n"
    if kind == "String":
        return f'"{value}"'
    return _js_value(value)


_JAVA_ITEM = {"integer": "int", "String": "String", "boolean": "boolean", "double": "double"}


def _java_items(values: Sequence[Any], items: str, quoted: bool = True) -> str:
    if items in ("String", "char") and not quoted:
        return ", ".join(str(v) for v in values)
    if items in ("String", "char"):
        quote = "'" if items == "char" else '"'
        return ", ".join(f"{quote}{v}{quote}" for v in values)
    return ", ".join(_java_value(v) for v in values)


def _java_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def _js_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_js_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_js_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)
