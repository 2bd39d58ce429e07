"""Task sets of the tool-call env, selected by name, each with a fixed held-out split.

Names: any BFCL v4 category (`envs.toolcall.bfcl.SINGLE_TURN`, `MULTI_TURN`), the groups
"bfcl_single_turn", "bfcl_live", "bfcl_multi_turn", "tau2_retail", "tau2_airline", "tau2",
and "shop" (generated shopping sums with looked-up prices, `envs.toolcall.shop`). BFCL ships
no split: every fifth item of a category (by position) is held out as "test". tau2 ships its
own fixed train / test split, used as it is; shop generates its own, disjoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from envs.toolcall import bfcl, shop, taubench

SPLITS = ("train", "test", "all")
GROUPS: dict[str, tuple[str, ...]] = {
    "bfcl_single_turn": bfcl.SINGLE_TURN,
    "bfcl_live": tuple(c for c in bfcl.SINGLE_TURN if c.startswith("live_")),
    "bfcl_multi_turn": bfcl.MULTI_TURN,
    "tau2": ("tau2_retail", "tau2_airline"),
}
Kind = Literal["bfcl_single", "bfcl_multi", "tau2", "shop"]
SHOP = "shop"


@dataclass(frozen=True)
class ToolCallTask:
    """One task of any set.

    Attributes:
        task_id: "bfcl/<BFCL id>", "tau2/<domain>/<tau2 id>" or "shop/<split>/<index>".
        kind: how it is played and graded.
        category: the BFCL category, the tau2 domain, or "shop".
        data: the BFCL item (with "answer"), the tau2 `Task` or the `shop.ShopTask`.
    """

    task_id: str
    kind: Kind
    category: str
    data: Any


def resolve(names: str | Sequence[str]) -> tuple[str, ...]:
    """Set names with the groups expanded, in order, without repeats."""
    listed = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    known = set(bfcl.SINGLE_TURN + bfcl.MULTI_TURN) | {f"tau2_{d}" for d in taubench.DOMAINS}
    known.add(SHOP)
    out: list[str] = []
    for name in listed:
        for member in GROUPS.get(name, (name,)):
            if member not in known:
                choices = ", ".join(sorted(known | set(GROUPS)))
                raise ValueError(f"unknown tool-call task set {member!r}; choose among {choices}")
            if member not in out:
                out.append(member)
    return tuple(out)


def load_task_set(names: str | Sequence[str], split: str) -> dict[str, ToolCallTask]:
    """Every task of the named sets in a split, by id."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    tasks: dict[str, ToolCallTask] = {}
    for name in resolve(names):
        for task in _load_set(name, split):
            tasks[task.task_id] = task
    return tasks


def _load_set(name: str, split: str) -> list[ToolCallTask]:
    if name == SHOP:
        splits = shop.SPLIT_SIZES if split == "all" else (split,)
        return [
            ToolCallTask(task.task_id, "shop", SHOP, task)
            for part in splits
            for task in shop.load_tasks(part).values()
        ]
    if name.startswith("tau2_"):
        domain = name.removeprefix("tau2_")
        held = taubench.split_ids(domain, "test")
        return [
            ToolCallTask(f"tau2/{domain}/{task.id}", "tau2", domain, task)
            for task in taubench.load_tasks(domain)
            if split == "all" or (task.id in held) == (split == "test")
        ]
    kind: Kind = "bfcl_multi" if name in bfcl.MULTI_TURN else "bfcl_single"
    return [
        ToolCallTask(f"bfcl/{item['id']}", kind, name, item)
        for index, item in enumerate(bfcl.load_category(name))
        if split == "all" or (index % 5 == 4) == (split == "test")
    ]
