"""Procedural bugs: one small AST mutation of one line of a project's code.

Each candidate is a single-line edit of the kind people make by mistake: a flipped
comparison, `+` for `-`, `or` for `and`, a dropped `not`, an off-by-one constant, two
arguments swapped. Only the mutated expression's text changes (the rest of the line keeps
its formatting), so the fix is a one-line diff. Candidates are restricted to lines the test
suite executes: a mutation nowhere near the tests cannot make one fail.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

_COMPARE_SWAPS: dict[type[ast.cmpop], str] = {
    ast.Lt: "<=",
    ast.LtE: "<",
    ast.Gt: ">=",
    ast.GtE: ">",
    ast.Eq: "!=",
    ast.NotEq: "==",
    ast.Is: "is not",
    ast.IsNot: "is",
    ast.In: "not in",
    ast.NotIn: "in",
}
_BINOP_SWAPS: dict[type[ast.operator], tuple[str, str]] = {
    ast.Add: ("+", "-"),
    ast.Sub: ("-", "+"),
    ast.Mult: ("*", "+"),
    ast.FloorDiv: ("//", "*"),
    ast.Mod: ("%", "//"),
}


@dataclass(frozen=True)
class Mutation:
    """One candidate bug.

    Attributes:
        path: the file, relative to the project's tree.
        line: 1-based line number.
        function: qualified name of the function it is in.
        kind: which operator made it.
        before: the line as it was.
        after: the line with the bug.
    """

    path: str
    line: int
    function: str
    kind: str
    before: str
    after: str

    def apply(self, source: str) -> str:
        """`source` with this mutation's line replaced."""
        lines = source.splitlines(keepends=True)
        ending = lines[self.line - 1][len(lines[self.line - 1].rstrip("\r\n")) :]
        if lines[self.line - 1].rstrip("\r\n") != self.before:
            raise ValueError(f"{self.path}:{self.line} is not the line this mutation expects")
        lines[self.line - 1] = self.after + ending
        return "".join(lines)


def mutations(path: str, source: str, covered: set[int]) -> Iterator[Mutation]:
    """Every candidate mutation of `source` on a `covered` line inside a function."""
    lines = source.splitlines()
    tree = ast.parse(source)
    for function, node in _function_nodes(tree):
        line = getattr(node, "lineno", None)
        if line is None or line not in covered or getattr(node, "end_lineno", line) != line:
            continue
        text = lines[line - 1]
        for kind, after in _edits(node, text):
            if after != text and _parses(lines, line, after):
                yield Mutation(path, line, function, kind, text, after)


def _function_nodes(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """(qualified function name, node) for every expression node inside a function body."""

    def visit(node: ast.AST, prefix: str, inside: str | None) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                for statement in child.body:
                    yield from visit_statement(statement, name)
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.", inside)
            elif inside is not None:
                yield inside, child
                yield from visit(child, prefix, inside)

    def visit_statement(statement: ast.AST, name: str) -> Iterator[tuple[str, ast.AST]]:
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield from visit(ast.Module(body=[statement], type_ignores=[]), f"{name}.", None)
            return
        yield name, statement
        yield from visit(statement, f"{name}.", name)

    yield from visit(tree, "", None)


def _segment(text: str, node: ast.AST) -> tuple[int, int]:
    """Character offsets of a single-line node in its line (ast gives UTF-8 byte offsets)."""
    raw = text.encode()
    start = len(raw[: node.col_offset].decode(errors="replace"))  # type: ignore[attr-defined]
    end = len(raw[: node.end_col_offset].decode(errors="replace"))  # type: ignore[attr-defined]
    return start, end


def _edits(node: ast.AST, text: str) -> Iterator[tuple[str, str]]:
    """(kind, mutated line) for each mutation that applies to `node`."""
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        new = _COMPARE_SWAPS.get(type(node.ops[0]))
        if new is not None:
            yield "compare", _between(text, node.left, node.comparators[0], new)
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAPS:
        old, new = _BINOP_SWAPS[type(node.op)]
        if not _is_text(node.left) and not _is_text(node.right):  # "%" formats strings
            yield "binop", _between(text, node.left, node.right, new, old)
    elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
        new = "or" if isinstance(node.op, ast.And) else "and"
        yield "boolop", _between(text, node.values[0], node.values[1], new)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        start, end = _segment(text, node)
        operand_start, operand_end = _segment(text, node.operand)
        yield "not", text[:start] + text[operand_start:operand_end] + text[end:]
    elif isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= 9:
        start, end = _segment(text, node)
        if text[start:end].isdigit():
            yield "constant", text[:start] + str(node.value + 1) + text[end:]
    elif isinstance(node, ast.Call) and len(node.args) == 2 and not node.keywords:
        first, second = node.args
        if isinstance(first, ast.Name) and isinstance(second, ast.Name) and first.id != second.id:
            a, b = _segment(text, first), _segment(text, second)
            yield (
                "arguments",
                text[: a[0]] + second.id + text[a[1] : b[0]] + first.id + text[b[1] :],
            )


def _between(text: str, left: ast.AST, right: ast.AST, new: str, old: str | None = None) -> str:
    """The line with the operator between `left` and `right` replaced by `new`."""
    _, left_end = _segment(text, left)
    right_start, _ = _segment(text, right)
    middle = text[left_end:right_start]
    stripped = middle.strip(" ()")
    if old is not None and stripped != old:
        return text
    replaced = middle.replace(stripped, new, 1) if stripped else middle
    return text[:left_end] + replaced + text[right_start:]


def _is_text(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant | ast.JoinedStr) and isinstance(
        getattr(node, "value", ""), str | bytes
    )


def _parses(lines: list[str], line: int, after: str) -> bool:
    changed = [*lines[: line - 1], after, *lines[line:]]
    try:
        ast.parse("\n".join(changed))
    except SyntaxError:
        return False
    return True
