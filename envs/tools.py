"""Tools declared once, from typed Python functions, as OpenAI tool schemas.

A tool is a plain function with type hints and a Google-style docstring; `Tool.from_function`
derives its JSON schema, and `Tool.bind` checks a model's JSON arguments against it. Every
problem with a call (unknown name, bad JSON, a missing or mistyped argument) is a
`ToolCallError` whose message is written for the agent to read and fix its next call.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin

JsonSchema = dict[str, Any]

_SCALARS: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


class ToolCallError(ValueError):
    """A call the agent got wrong; the message is shown to the agent as is."""


def _schema_of(annotation: Any) -> JsonSchema:
    """JSON schema of a type hint: scalars, Literal, lists, dicts and optionals."""
    origin = get_origin(annotation)
    if annotation in _SCALARS:
        return {"type": _SCALARS[annotation]}
    if origin is Literal:
        values = list(get_args(annotation))
        return {"type": _SCALARS[type(values[0])], "enum": values}
    if origin in (list, Sequence, tuple):
        args = get_args(annotation)
        return {"type": "array", "items": _schema_of(args[0])} if args else {"type": "array"}
    if origin in (dict, Mapping) or annotation is dict:
        return {"type": "object"}
    if origin in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _schema_of(members[0])
        return {"anyOf": [_schema_of(m) for m in members]}
    if annotation is Any:
        return {}
    raise TypeError(f"tool argument type {annotation!r} has no JSON schema; use str, int, ...")


def _docstring_args(doc: str) -> tuple[str, dict[str, str]]:
    """Splits a Google-style docstring into its summary and per-argument descriptions."""
    summary, _, rest = doc.partition("\nArgs:")
    described: dict[str, str] = {}
    current = None
    for line in rest.splitlines():
        if re.match(r"^\s*(Returns|Raises|Yields|Examples?):", line):
            break
        match = re.match(r"^\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)$", line)
        if match:
            current = match.group(1)
            described[current] = match.group(2).strip()
        elif current and line.strip():
            described[current] += " " + line.strip()
    return " ".join(summary.split()), described


def _matches(value: Any, schema: JsonSchema) -> bool:
    """Whether a decoded JSON value fits a schema made by `_schema_of`."""
    if "anyOf" in schema:
        return any(_matches(value, option) for option in schema["anyOf"])
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind is None:
        return True
    if kind == "array":
        items = schema.get("items", {})
        return isinstance(value, list) and all(_matches(v, items) for v in value)
    checks: dict[str, Callable[[Any], bool]] = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "object": lambda v: isinstance(v, dict),
    }
    return checks[kind](value)


@dataclass(frozen=True)
class Tool:
    """One callable tool: its name, description, JSON schema of parameters and function."""

    name: str
    description: str
    parameters: JsonSchema
    function: Callable[..., Any] = field(repr=False)

    @classmethod
    def from_function(cls, function: Callable[..., Any], name: str | None = None) -> Tool:
        """Declares a tool from a typed function; its docstring gives the descriptions."""
        summary, described = _docstring_args(inspect.getdoc(function) or "")
        hints = typing.get_type_hints(function)
        properties: dict[str, JsonSchema] = {}
        required: list[str] = []
        for param in inspect.signature(function).parameters.values():
            if param.name == "self":
                continue
            if param.name not in hints:
                raise TypeError(f"tool argument {param.name!r} of {function.__name__} needs a type")
            prop = _schema_of(hints[param.name])
            if param.name in described:
                prop["description"] = described[param.name]
            properties[param.name] = prop
            if param.default is inspect.Parameter.empty:
                required.append(param.name)
        parameters = {"type": "object", "properties": properties, "required": required}
        return cls(name or function.__name__, summary, parameters, function)

    @property
    def schema(self) -> JsonSchema:
        """The OpenAI `tools` entry for this tool."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": json.loads(json.dumps(self.parameters)),
            },
        }

    def bind(self, arguments: str | Mapping[str, Any] | None) -> dict[str, Any]:
        """Decodes and checks a call's arguments; raises `ToolCallError` on any mistake."""
        if arguments is None or arguments == "":
            decoded: Any = {}
        elif isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
            except json.JSONDecodeError as error:
                raise ToolCallError(
                    f"arguments of {self.name} are not valid JSON ({error.msg} at character "
                    f"{error.pos}); send a JSON object such as {self._example()}"
                ) from None
        else:
            decoded = dict(arguments)
        if not isinstance(decoded, dict):
            raise ToolCallError(f"arguments of {self.name} must be a JSON object, not {decoded!r}")
        properties = self.parameters["properties"]
        unknown = sorted(set(decoded) - set(properties))
        if unknown:
            raise ToolCallError(
                f"{self.name} has no argument {', '.join(unknown)}; "
                f"its arguments are {', '.join(properties) or 'none'}"
            )
        absent = [n for n in self.parameters["required"] if n not in decoded]
        if absent:
            raise ToolCallError(f"{self.name} is missing required argument {', '.join(absent)}")
        for arg, value in decoded.items():
            if not _matches(value, properties[arg]):
                raise ToolCallError(
                    f"argument {arg} of {self.name} should be {_describe(properties[arg])}, "
                    f"got {json.dumps(value)}"
                )
        return decoded

    def _example(self) -> str:
        return json.dumps({n: f"<{n}>" for n in self.parameters["required"]})


def _describe(schema: JsonSchema) -> str:
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(v) for v in schema["enum"])
    if "anyOf" in schema:
        return " or ".join(_describe(s) for s in schema["anyOf"])
    return f"a JSON {schema.get('type', 'value')}"
