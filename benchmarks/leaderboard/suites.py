"""Suites and task sets: what a leaderboard evaluates, as one registry.

A *task set* is an environment variant on its held-out split (the env's own `split`
kwarg), optionally narrowed to some tasks, with the reference (oracle) agent that solves
it, if there is one, and the rule that turns an episode into success and score. A *suite*
is a list of task set names. Adding an environment family takes a few lines:

    TASK_SETS["swe/test"] = TaskSet("swe/test", "clawgym/SWE-v0", {"split": "test"},
                                    oracle="envs.swe.env:SWEReferenceAgent")
    FAMILIES["swe"] = ("swe/test",)
    SMOKE["smoke/swe"] = ("swe/test", 2, {"max_turns": 4})   # optional

(or `register_family("swe", [...])`, which does the three).

`full` is every family's task sets; `smoke` is a few tasks of each, for a quick check.
Nothing here imports an environment: entry points are strings, resolved when a suite runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from envs.core import ScriptedAgent, solved


@dataclass(frozen=True)
class EpisodeTrace:
    """What a scorer sees of one finished episode: the env's rewards and infos per step."""

    task_id: str
    rewards: tuple[float, ...]
    infos: tuple[Mapping[str, Any], ...]
    """The reset info, then one info per step."""
    terminated: bool
    truncated: bool

    @property
    def reward(self) -> float:
        return sum(self.rewards)


@dataclass(frozen=True)
class Outcome:
    """A task set's verdict on one episode."""

    success: bool
    score: float
    """The task set's evaluation score: the env's reward unless the family says otherwise."""


Scorer = Callable[[EpisodeTrace], Outcome]


def reward_outcome(trace: EpisodeTrace) -> Outcome:
    """Success is full reward (1): Arith, Terminal (all tests pass), GUI, tool calls."""
    return Outcome(solved(trace.reward), trace.reward)


def chat_outcome(trace: EpisodeTrace) -> Outcome:
    """Chat-v0's reward is always 0 (its signal is the judge's); evaluation reads the persona's
    preference score from `info`: score is its mean over replies, success is every question
    ending with a satisfied user."""
    scores = [i["preference_score"] for i in trace.infos if i.get("preference_score") is not None]
    verdicts = [i.get("user_verdict") for i in trace.infos[1:]]
    satisfied = trace.terminated and "gave_up" not in verdicts and "satisfied" in verdicts
    return Outcome(satisfied, sum(scores) / len(scores) if scores else 0.0)


OracleFactory = Callable[[Any], ScriptedAgent]
"""Builds the reference agent of one episode from the env (unwrapped), after its reset."""


@dataclass(frozen=True)
class TaskSet:
    """One environment variant on held-out tasks (see the module docstring).

    Attributes:
        name: "<family>/<set>", unique in `TASK_SETS`.
        env_id: a registered clawgym env id.
        kwargs: the variant's registration kwargs; they choose the held-out split.
        oracle: "module:callable" taking the env, returning the reference agent; None when
            the task set has no reference solver.
        where: "module:callable" keeping a task id (True) or not; None keeps every task.
        limit: evaluate this many tasks, evenly spaced over the split; None: all of them.
        score: turns an episode into success and score.
        exporter: "module:callable" writing the field's own output format (SWE-bench
            predictions, BFCL results) from a task set's episodes; see `exports`.
    """

    name: str
    env_id: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    oracle: str | None = None
    where: str | None = None
    limit: int | None = None
    score: Scorer = reward_outcome
    exporter: str | None = None

    def env_kwargs(self) -> dict[str, Any]:
        return dict(self.kwargs)

    def oracle_factory(self) -> OracleFactory | None:
        return None if self.oracle is None else load_object(self.oracle)

    def select(self, task_ids: Sequence[str]) -> list[str]:
        """The task ids this set evaluates, deterministically."""
        keep = load_object(self.where) if self.where else None
        ids = [t for t in task_ids if keep is None or keep(t)]
        if self.limit is None or self.limit >= len(ids):
            return ids
        # Evenly spaced rather than the first few: Chat's ids are grouped by persona,
        # Terminal's by source, so a prefix would test one persona or one kind of task.
        return [ids[i * len(ids) // self.limit] for i in range(self.limit)]


def load_object(entry_point: str) -> Any:
    """`module:attribute` to the object, imported on demand."""
    module, _, attribute = entry_point.partition(":")
    if not attribute:
        raise ValueError(f"expected 'module:attribute', got {entry_point!r}")
    return getattr(importlib.import_module(module), attribute)


# -- family-specific pieces, referenced by entry point ----------------------------------
def gui_oracle(env: Any) -> ScriptedAgent:
    """MiniWoB++'s scripted solver of the episode's task."""
    from envs.gui.solvers import ScriptedGUIAgent

    return ScriptedGUIAgent(env.task.name)


def gui_has_solver(task_id: str) -> bool:
    from envs.gui.solvers import SOLVERS

    return task_id.removeprefix("miniwob/") in SOLVERS


def gui_lacks_solver(task_id: str) -> bool:
    return not gui_has_solver(task_id)


# -- the registry -------------------------------------------------------------------------
# Terminal pins bubblewrap: "auto" would pick Docker whenever a daemon happens to answer,
# and a result must not depend on what else runs on the machine.
TASK_SETS: dict[str, TaskSet] = {
    t.name: t
    for t in (
        TaskSet(
            "arith/test",
            "clawgym/Arith-v0",
            {"split": "test"},
            oracle="envs.arith.env:ArithReferenceAgent",
        ),
        TaskSet(
            "chat/test",
            "clawgym/Chat-v0",
            {"split": "test"},
            oracle="envs.chat.env:ChatReferenceAgent",
            score=chat_outcome,
        ),
        TaskSet(
            "terminal/tbench-test",
            "clawgym/Terminal-v0",
            {"tasks": "tbench", "split": "test", "sandbox": "bwrap"},
            oracle="envs.terminal.env:TerminalReferenceAgent",
        ),
        TaskSet(
            "terminal/icalfa-test",
            "clawgym/Terminal-v0",
            {"tasks": "icalfa", "split": "test", "sandbox": "bwrap"},
            oracle="envs.terminal.env:TerminalReferenceAgent",
        ),
        # GUI's held-out families, split by whether a scripted solver exists, so that a
        # task set's oracle solves all of it; together they are the whole held-out split.
        TaskSet(
            "gui/test-scripted",
            "clawgym/GUI-v0",
            {"split": "test"},
            oracle="benchmarks.leaderboard.suites:gui_oracle",
            where="benchmarks.leaderboard.suites:gui_has_solver",
        ),
        TaskSet(
            "gui/test-other",
            "clawgym/GUI-v0",
            {"split": "test"},
            where="benchmarks.leaderboard.suites:gui_lacks_solver",
        ),
        # The same held-out GUI tasks seen as a screenshot alone, acted on by pixel tools: for
        # vision-language policies (`policy=tiny-vl`, a VL checkpoint). No family holds it,
        # so `suite=full` never shows a text-only model pictures; no oracle, since the
        # scripted solvers act on element ids, which a screenshot does not show.
        TaskSet(
            "gui/test-screenshot",
            "clawgym/GUI-v0",
            {"split": "test", "observation": "screenshot"},
        ),
        # BFCL single-turn is graded by bfcl-eval's AST checker inside the env; the exporter
        # writes BFCL's result lines so that its own CLI can re-score them.
        TaskSet(
            "toolcall/bfcl-test",
            "clawgym/ToolCall-v0",
            {"tasks": "bfcl_single_turn", "split": "test"},
            oracle="envs.toolcall.env:ToolCallReferenceAgent",
            exporter="benchmarks.leaderboard.exports:bfcl_results",
        ),
        TaskSet(
            "toolcall/bfcl-multi-test",
            "clawgym/ToolCall-v0",
            {"tasks": "bfcl_multi_turn", "split": "test", "sandbox": "bwrap"},
            oracle="envs.toolcall.env:ToolCallReferenceAgent",
        ),
        TaskSet(
            "toolcall/tau2-test",
            "clawgym/ToolCall-v0",
            {"tasks": "tau2", "split": "test"},
            oracle="envs.toolcall.env:ToolCallReferenceAgent",
        ),
        # SWE-v0 on bubblewrap for the same reason as Terminal; its exporter writes
        # SWE-bench's predictions file for swebench's own harness.
        TaskSet(
            "swe/test",
            "clawgym/SWE-v0",
            {"split": "test", "sandbox": "bwrap"},
            oracle="envs.swe.env:SWEReferenceAgent",
            exporter="benchmarks.leaderboard.exports:swe_predictions",
        ),
    )
}

FAMILIES: dict[str, tuple[str, ...]] = {
    "arith": ("arith/test",),
    "chat": ("chat/test",),
    "terminal": ("terminal/tbench-test", "terminal/icalfa-test"),
    "gui": ("gui/test-scripted", "gui/test-other"),
    "toolcall": ("toolcall/bfcl-test", "toolcall/bfcl-multi-test", "toolcall/tau2-test"),
    "swe": ("swe/test",),
}
"""Suites per environment family: `suite=<family>`."""

SMOKE: dict[str, tuple[str, int, Mapping[str, Any]]] = {
    # Short turn budgets (enough for every oracle) keep a small model's episodes short.
    "smoke/arith": ("arith/test", 4, {"max_turns": 3}),
    "smoke/chat": ("chat/test", 3, {"questions_per_episode": 1, "patience": 1}),
    "smoke/terminal": ("terminal/tbench-test", 2, {"max_turns": 3}),
    "smoke/gui": ("gui/test-scripted", 2, {"max_turns": 3}),
    "smoke/toolcall": ("toolcall/bfcl-test", 3, {}),
    "smoke/swe": ("swe/test", 1, {"max_turns": 3}),
}
"""The smoke suite: (task set, tasks, extra kwargs) under a name of its own, because its
task ids are not the full set's and its numbers must never be mixed with the full set's."""


def register_family(family: str, task_sets: Sequence[TaskSet], smoke: int | None = 2) -> None:
    """Adds an environment family's task sets (and, with `smoke`, a slice to the smoke suite)."""
    for task_set in task_sets:
        TASK_SETS[task_set.name] = task_set
    FAMILIES[family] = tuple(t.name for t in task_sets)
    if smoke:
        SMOKE[f"smoke/{family}"] = (task_sets[0].name, smoke, {})


def suite_names() -> list[str]:
    return [*FAMILIES, "full", "smoke"]


def suite(name: str, limit: int | None = None) -> list[TaskSet]:
    """The task sets of a suite; `limit` caps the tasks of each (and names it so)."""
    if name == "smoke":
        chosen = [
            replace(TASK_SETS[base], name=alias, limit=n, kwargs={**TASK_SETS[base].kwargs, **kw})
            for alias, (base, n, kw) in SMOKE.items()
        ]
    elif name == "full":
        chosen = [TASK_SETS[t] for family in FAMILIES.values() for t in family]
    elif name in FAMILIES:
        chosen = [TASK_SETS[t] for t in FAMILIES[name]]
    elif name in TASK_SETS:
        chosen = [TASK_SETS[name]]
    else:
        raise ValueError(
            f"unknown suite {name!r}; choose one of {', '.join(suite_names())} or a task set "
            f"({', '.join(TASK_SETS)})"
        )
    if limit is None:
        return chosen
    return [
        replace(t, name=f"{t.name}[{limit}]", limit=min(limit, t.limit or limit)) for t in chosen
    ]
