"""The "shop" task set of the tool-call env: shopping sums whose prices must be looked up.

Each task is a shopping list ("Ana buys 3 apples and 2 pears. How much does Ana pay in
total?") over a small price table of its own that the question does not show. The agent
asks `price` what each line of the list costs (an item and its quantity), adds the lines up
with `calculator`, and calls `answer` with the total: three kinds of call, at least four
calls, in three turns or more. The first
`answer` ends the episode: 1 if it is the exact total the env computed from its own table,
else 0. Nothing before the answer tells the agent the total or whether it is on the way to it.

Why it exists: it is a multi-step tool task that a 135M model can partly do after a short
imitation, so that RL has groups with both successes and failures to learn from (BFCL and
the terminal tasks are out of its reach; docs/results.md). Its difficulty lies in carrying
facts from one message to the next call: each item with its quantity from the question into
a lookup, each line's cost from the tool results into the sum. (A first version looked up
unit prices and left quantity times price to the calculator's expression; after 6 supervised
steps SmolLM2-135M solved none of 40 held-out tasks: it filled every slot of the expression
from the tool results, never from the question.)

Tasks are generated from fixed seeds (no download), so an id always means the same task.
The test split never repeats a training task (the same list at the same prices).
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass
from typing import Any

from envs.arith.tasks import evaluate
from envs.core import ERROR_PREFIX, Action, Message, ToolResult, tool_calls_message
from envs.tools import Tool

SPLIT_SIZES = {"train": 2000, "test": 300}
GOODS = (
    "apple", "pear", "lemon", "onion", "carrot", "egg", "candle", "pen", "cup", "plate",
    "towel", "sock", "hat", "bowl", "spoon", "fork", "book", "lamp", "mug", "kite",
)  # fmt: skip
"""Item names whose plural takes an "s", so the question's plural names the item too."""
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Goran", "Hana", "Ivo", "Jun")
ITEMS = (2, 3)
"""How many different items a task's list holds (each task draws one of these)."""
QUANTITIES = (2, 9)
PRICES = (2, 19)
"""Inclusive ranges: single-digit quantities, prices under 20."""
EXTRA_ITEMS = 2
"""Items in a task's price table beyond its list: looking up the wrong one costs."""

SYSTEM_PROMPT = (
    "You are a shopping assistant. The prices are not in the question: look each item up "
    "with the price tool, compute the total with the calculator, then call answer with the "
    "total."
)


@dataclass(frozen=True)
class ShopTask:
    """One shopping list and the price table behind it.

    Attributes:
        task_id: "shop/<split>/<index>".
        question: what the agent reads.
        order: (item, quantity) of each item on the list, in the question's order.
        prices: (item, price) of every item the shop sells in this task.
        answer: the total: the sum of quantity times price over the list.
    """

    task_id: str
    question: str
    order: tuple[tuple[str, int], ...]
    prices: tuple[tuple[str, int], ...]
    answer: int


def _draw(rng: random.Random) -> tuple[str, tuple[tuple[str, int], ...], dict[str, int]]:
    count = rng.choice(ITEMS)
    goods = rng.sample(GOODS, count + EXTRA_ITEMS)
    prices = {item: rng.randint(*PRICES) for item in goods}
    order = tuple((item, rng.randint(*QUANTITIES)) for item in goods[:count])
    name = rng.choice(NAMES)
    listed = [f"{quantity} {item}s" for item, quantity in order]
    joined = ", ".join(listed[:-1]) + f" and {listed[-1]}"
    question = f"{name} buys {joined}. How much does {name} pay in total?"
    return question, order, dict(sorted(prices.items()))


@functools.cache
def load_tasks(split: str) -> dict[str, ShopTask]:
    """Every task of a split ("train" or "test"), by id, in id order."""
    if split not in SPLIT_SIZES:
        raise ValueError(f"unknown shop split {split!r}; choose one of {sorted(SPLIT_SIZES)}")
    taken = set() if split == "train" else {_key(t) for t in load_tasks("train").values()}
    tasks: dict[str, ShopTask] = {}
    attempt = 0
    while len(tasks) < SPLIT_SIZES[split]:
        question, order, prices = _draw(random.Random(f"shop/{split}/{attempt}"))
        attempt += 1
        task_id = f"shop/{split}/{len(tasks):04d}"
        total = sum(quantity * prices[item] for item, quantity in order)
        task = ShopTask(task_id, question, order, tuple(prices.items()), total)
        if _key(task) in taken:
            continue
        taken.add(_key(task))
        tasks[task_id] = task
    return tasks


def _key(task: ShopTask) -> tuple[Any, ...]:
    """What makes two tasks the same problem: the list and the prices of what it holds (the
    buyer's name and the unused items' prices change nothing)."""
    prices = dict(task.prices)
    return tuple((item, quantity, prices[item]) for item, quantity in task.order)


class ShopSession:
    """One episode's tools over one task's price table."""

    def __init__(self, task: ShopTask):
        self.task = task
        self.prices = dict(task.prices)
        self.answered: float | None = None

    def messages(self) -> list[Message]:
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": self.task.question},
        ]

    def tools(self) -> list[Tool]:
        return [Tool.from_function(f) for f in (self.price, self.calculator, self.answer)]

    def price(self, item: str, quantity: int) -> str:
        """Looks up what a quantity of one item costs, in dollars.

        Args:
            item: the item's name, e.g. "apple".
            quantity: how many of it, e.g. 3.
        """
        name = item.strip().lower()
        if name not in self.prices and name.endswith("s") and name[:-1] in self.prices:
            name = name[:-1]  # "apples" names the item as well
        if name not in self.prices:
            sold = ", ".join(self.prices)
            return f"{ERROR_PREFIX}the shop has no {item!r}; it sells: {sold}"
        if quantity < 1:
            return f"{ERROR_PREFIX}quantity must be at least 1, got {quantity}"
        return str(quantity * self.prices[name])

    def calculator(self, expression: str) -> str:
        """Evaluates an arithmetic expression.

        Args:
            expression: numbers with + - * / and parentheses, e.g. "12 + 35".
        """
        try:
            value = evaluate(expression)
        except ValueError as error:
            return f"{ERROR_PREFIX}{error}"
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)

    def answer(self, total: float) -> ToolResult:
        """Gives the final answer, the total cost, and ends the task.

        Args:
            total: the total cost in dollars.
        """
        self.answered = total
        correct = self.correct(total)
        return ToolResult("correct" if correct else "incorrect", float(correct), terminated=True)

    def correct(self, total: float) -> bool:
        return math.isfinite(total) and abs(total - self.task.answer) < 1e-9


NO_CALL = "no tool was called; look the prices up with price, then call answer with the total"


def reference_action(task: ShopTask, observation: list[Message]) -> Action:
    """The scripted solver's next message, from what the tools said: every line's price in
    one message, then the calculator on their sum, then answer with its result. It reads
    the task's list (what the agent reads too), never its price table."""
    said = {m.get("name"): str(m.get("content")) for m in observation if m.get("role") == "tool"}
    if "calculator" in said:
        value = float(said["calculator"])
        total = int(value) if value.is_integer() else value  # as the calculator wrote it
        return tool_calls_message([("answer", {"total": total})])
    lines = [str(m["content"]) for m in observation if m.get("name") == "price"]
    if lines:
        return tool_calls_message([("calculator", {"expression": " + ".join(lines)})])
    calls = [("price", {"item": item, "quantity": q}) for item, q in task.order]
    return tool_calls_message(calls)
