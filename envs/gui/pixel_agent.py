"""The reference agent of a screenshot-only GUI episode: a task's scripted solver, its
element actions carried out as a screenshot agent has to (`PixelGUIAgent`).

A screenshot agent is shown no element list and no element actions, only `click_at`,
`type_keys`, `press_key`, `scroll` and `wait`. The solvers (`envs.gui.solvers`) decide from
the element list, so this agent reads it from the env, as every env's reference agent reads
its task (an oracle: its demonstrations teach a policy what to do on the pixels it is shown),
and turns each element action into pixel actions at the element's place on the screenshot:

    click(element)              -> click_at(its centre)
    type_text(element, text)    -> click_at(its centre), [press_key("Control+a") when the
                                   field holds text], type_keys(text)

`select_option` and `scroll` inside an element's box have no pixel form here; a solver that
needs one ends its episode with `NoPixelForm`, which the demonstration records as failed.
"""

from __future__ import annotations

from typing import Any, Protocol

from envs.core import Action, Message, tool_calls_message
from envs.gui.render import PageView
from envs.gui.solvers import SOLVERS, Call, View


class NoPixelForm(LookupError):
    """A solver's action that a screenshot agent cannot take."""


class ElementOracle(Protocol):
    """What the agent reads from the env: the page as a DOM agent would see it, and where
    an element sits on the screenshot."""

    view: PageView | None

    def element_point(self, element: int) -> tuple[float, float]: ...


class PixelGUIAgent:
    """Plays one MiniWoB++ task with its scripted solver on a screenshot agent's tools."""

    def __init__(self, env: ElementOracle, task_name: str):
        self.env, self.solver = env, SOLVERS[task_name]
        self.turn = 0

    def act(self, observation: list[Message], info: dict[str, Any]) -> Action:
        if "task_id" in info and info.get("turn") is None:
            self.turn = 0
        page = self.env.view
        assert page is not None, "the env shows no page yet"
        calls = self.solver(View(page.utterance, page.elements, self.turn))
        self.turn += 1
        pixels = [step for call in calls for step in self._on_pixels(call, page)]
        return tool_calls_message(pixels, id_prefix=f"call_{self.turn}")

    def _on_pixels(self, call: Call, page: PageView) -> list[Call]:
        name, arguments = call
        if name in ("press_key", "wait") or (name == "scroll" and "element" not in arguments):
            return [call]
        if name == "click":
            return [self._click_at(arguments["element"])]
        if name == "type_text":
            field = next((e for e in page.elements if e.id == arguments["element"]), None)
            holds_text = field is not None and bool(field.attrs.get("value"))
            select_all = [("press_key", {"key": "Control+a"})]
            return [
                self._click_at(arguments["element"]),
                *(select_all if holds_text and arguments.get("clear", True) else []),
                ("type_keys", {"text": arguments["text"]}),
            ]
        raise NoPixelForm(f"{name} {arguments} has no form a screenshot agent can take")

    def _click_at(self, element: int) -> Call:
        x, y = self.env.element_point(element)
        return ("click_at", {"x": round(x), "y": round(y)})
