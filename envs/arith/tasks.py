"""Arithmetic word problems, generated deterministically, with train and held-out splits.

Each problem comes from a template and numbers drawn from a generator seeded by the
task id, so a task id always means the same problem. The held-out split uses its own
seeds and never repeats a training problem's text.
"""

from __future__ import annotations

import ast
import functools
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass

SPLIT_SIZES = {"train": 500, "test": 100}

_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Goran", "Hana", "Ivo", "Jun")
_ITEMS = ("apple", "marble", "book", "stamp", "pencil", "card", "shell", "coin")


@dataclass(frozen=True)
class ArithTask:
    """One word problem with its gold expression and answer."""

    task_id: str
    question: str
    expression: str
    answer: float


def _problem(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b, c = rng.randint(2, 60), rng.randint(2, 12), rng.randint(2, 25)
    templates: list[Callable[[], tuple[str, str]]] = [
        lambda: (
            f"{name} has {a} {item}s and buys {b} packs of {c} {item}s. "
            f"How many {item}s does {name} have now?",
            f"{a} + {b} * {c}",
        ),
        lambda: (
            f"A train runs at {a} km per hour for {b} hours, then {c} km more. "
            "How many km does it travel in total?",
            f"{a} * {b} + {c}",
        ),
        lambda: (
            f"{name} shares {a * b} {item}s equally among {b} friends. "
            f"How many {item}s does each friend get?",
            f"{a * b} / {b}",
        ),
        lambda: (
            f"{b} {item}s cost {c} dollars each. {name} pays with {b * c + a} dollars. "
            f"How much change does {name} get back?",
            f"{b * c + a} - {b} * {c}",
        ),
        lambda: (
            f"A shop sells {a * 10} {item}s on Monday and {c}% more on Tuesday. "
            "How many does it sell on Tuesday?",
            f"{a * 10} * (100 + {c}) / 100",
        ),
        lambda: (
            f"{name} reads {c} pages a day for {b} weeks. How many pages is that?",
            f"{c} * {b} * 7",
        ),
    ]
    return rng.choice(templates)()


@functools.cache
def load_tasks(split: str) -> dict[str, ArithTask]:
    """All tasks of a split, by id."""
    if split not in SPLIT_SIZES:
        raise ValueError(f"unknown split {split!r}; choose one of {sorted(SPLIT_SIZES)}")
    seen_elsewhere = (
        set() if split == "train" else {t.question for t in load_tasks("train").values()}
    )
    tasks: dict[str, ArithTask] = {}
    attempt = 0
    while len(tasks) < SPLIT_SIZES[split]:
        rng = random.Random(f"arith/{split}/{attempt}")
        attempt += 1
        question, expression = _problem(rng)
        if question in seen_elsewhere or any(t.question == question for t in tasks.values()):
            continue
        task_id = f"arith/{split}/{len(tasks):04d}"
        tasks[task_id] = ArithTask(task_id, question, expression, evaluate(expression))
    return tasks


_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def evaluate(expression: str) -> float:
    """Evaluates an arithmetic expression safely; raises ValueError with a readable reason."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r} as arithmetic") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        if isinstance(node.value, bool):
            raise ValueError("booleans are not numbers here")
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ValueError("exponent too large")
        try:
            return _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
    raise ValueError(f"unsupported element {ast.dump(node)[:40]}; use numbers, + - * / // % ** ( )")
