"""Scripted reference solvers for MiniWoB++ tasks, acting only on what the agent sees.

Each solver reads the instruction and the rendered page from the latest observation
(`envs.gui.render.parse_rendering`, nothing from inside the browser) and returns the tool
calls of its next assistant message. They are the gold half of the GUI env's tests: a
solver earning the page's full reward shows that the observation carries what the task
needs and that the tools do what they say.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from envs.core import Action, Message, tool_calls_message
from envs.gui.render import Element, parse_rendering

Call = tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class View:
    """The latest page as a solver sees it."""

    utterance: str
    elements: tuple[Element, ...]
    turn: int

    def find(self, tag: str | None = None, text: str | None = None, **attrs: Any) -> Element:
        """The first element matching all the given conditions."""
        for element in self.all(tag, text, **attrs):
            return element
        raise LookupError(f"no element tag={tag} text={text!r} {attrs} in {self.utterance!r}")

    def all(self, tag: str | None = None, text: str | None = None, **attrs: Any) -> list[Element]:
        return [
            e
            for e in self.elements
            if (tag is None or e.tag == tag)
            and (text is None or e.text == text)
            and all(_has(e, key, value) for key, value in attrs.items())
        ]

    def quoted(self, index: int = 0) -> str:
        """The `index`-th double-quoted string of the instruction."""
        return re.findall(r'"([^"]*)"', self.utterance)[index]

    def inputs(self) -> list[Element]:
        return [e for e in self.elements if e.tag in ("input", "textarea")]

    def children(self, parent: Element) -> list[Element]:
        """Elements nested under `parent` (at any depth)."""
        start = self.elements.index(parent)
        nested = []
        for element in self.elements[start + 1 :]:
            if element.depth <= parent.depth:
                break
            nested.append(element)
        return nested


def _has(element: Element, key: str, value: Any) -> bool:
    if key == "cls":
        return value in str(element.attrs.get("class", "")).split()
    return element.attrs.get(key) == value


def _need(match: re.Match[str] | None) -> re.Match[str]:
    """A match the solver relies on; a page that does not read as expected is a LookupError."""
    if match is None:
        raise LookupError("the page does not read as this solver expects")
    return match


def click(element: Element) -> Call:
    return ("click", {"element": element.id})


def type_into(element: Element, text: str) -> Call:
    return ("type_text", {"element": element.id, "text": text})


def submit(view: View, text: str = "Submit") -> Call:
    return click(view.find("button", text))


# Sections open with an animation: a solver waits it out before looking again.
_SETTLE: Call = ("wait", {"seconds": 0.6})

Solver = Callable[[View], list[Call]]
SOLVERS: dict[str, Solver] = {}


def solves(*names: str) -> Callable[[Solver], Solver]:
    def register(solver: Solver) -> Solver:
        for name in names:
            SOLVERS[name] = solver
        return solver

    return register


@solves("click-test")
def _click_test(view: View) -> list[Call]:
    return [click(view.find("button", "Click Me!"))]


@solves("click-test-2", "click-test-transfer")
def _click_test_2(view: View) -> list[Call]:
    name = _need(re.search(r"button (\w+)", view.utterance))
    return [click(view.find("button", name.group(1)))]


@solves("click-button", "unicode-test")
def _click_button(view: View) -> list[Call]:
    return [click(view.find("button", view.quoted()))]


@solves("click-button-sequence")
def _click_button_sequence(view: View) -> list[Call]:
    return [click(view.find("button", "ONE")), click(view.find("button", "TWO"))]


@solves("click-checkboxes", "click-checkboxes-large", "click-checkboxes-transfer", "click-option")
def _click_checkboxes(view: View) -> list[Call]:
    match = _need(re.match(r"Select (.*) and click Submit", view.utterance))
    wanted = set() if match.group(1) == "nothing" else set(match.group(1).split(", "))
    calls = []
    for label in view.all("label"):
        box = view.children(label)[0]
        if label.text in wanted and box.attrs.get("checked") != "true":
            calls.append(click(box))
    return [*calls, submit(view)]


@solves("click-link")
def _click_link(view: View) -> list[Call]:
    return [click(view.find("span", view.quoted(), cls="alink"))]


@solves("click-dialog")
def _click_dialog(view: View) -> list[Call]:
    return [click(view.find("button", title="Close"))]


@solves("click-dialog-2")
def _click_dialog_2(view: View) -> list[Call]:
    label = view.quoted()
    if label == "x":
        return [click(view.find("button", title="Close"))]
    return [click(view.find("button", label, type="button"))]


@solves("click-tab")
def _click_tab(view: View) -> list[Call]:
    match = _need(re.search(r"Tab #\d+", view.utterance))
    return [click(view.find("a", match.group(0)))]


@solves("click-tab-2", "click-tab-2-easy", "click-tab-2-medium", "click-tab-2-hard")
def _click_tab_2(view: View) -> list[Call]:
    links = view.all("span", view.quoted(), cls="alink")
    if links:
        return [click(links[0])]
    tabs = view.all("a", cls="ui-tabs-anchor")
    return [click(tabs[(view.turn + 1) % len(tabs)])]


@solves("click-collapsible", "click-collapsible-nodelay")
def _click_collapsible(view: View) -> list[Call]:
    if view.turn == 0:
        return [click(view.find("h3")), _SETTLE]
    return [submit(view)]


@solves("click-collapsible-2", "click-collapsible-2-nodelay")
def _click_collapsible_2(view: View) -> list[Call]:
    links = view.all("span", view.quoted(), cls="alink")
    if links:
        return [click(links[0])]
    headers = view.all("h3")
    return [click(headers[view.turn % len(headers)]), _SETTLE]


@solves("enter-text", "enter-text-dynamic")
def _enter_text(view: View) -> list[Call]:
    return [type_into(view.find("input", id="tt"), view.quoted()), submit(view)]


@solves("enter-text-2")
def _enter_text_2(view: View) -> list[Call]:
    text = view.quoted()
    text = text.lower() if "lower case" in view.utterance else text.upper()
    return [type_into(view.find("input", id="tt"), text), submit(view)]


@solves("enter-password")
def _enter_password(view: View) -> list[Call]:
    password = view.quoted()
    return [
        type_into(view.find("input", id="password"), password),
        type_into(view.find("input", id="verify"), password),
        submit(view),
    ]


@solves("login-user")
def _login_user(view: View) -> list[Call]:
    return [
        type_into(view.find("input", id="username"), view.quoted(0)),
        type_into(view.find("input", id="password"), view.quoted(1)),
        submit(view, "Login"),
    ]


@solves("focus-text")
def _focus_text(view: View) -> list[Call]:
    return [click(view.find("input", id="tt"))]


@solves("focus-text-2")
def _focus_text_2(view: View) -> list[Call]:
    match = _need(re.search(r"(\d)(st|nd|rd|th)", view.utterance))
    return [click(view.all("input")[int(match.group(1)) - 1])]


@solves("choose-list")
def _choose_list(view: View) -> list[Call]:
    match = _need(re.match(r"Select (.*) from the list", view.utterance))
    option = ("select_option", {"element": view.find("select").id, "option": match.group(1)})
    return [option, submit(view)]


@solves("read-table")
def _read_table(view: View) -> list[Call]:
    match = _need(re.match(r"Enter the value of (.*) into the text field", view.utterance))
    cells = view.all("td")
    key = next(i for i, cell in enumerate(cells) if cell.text == match.group(1))
    return [type_into(view.find("input", id="tt"), cells[key + 1].text), submit(view)]


@solves("simple-arithmetic")
def _simple_arithmetic(view: View) -> list[Call]:
    match = _need(re.match(r"(-?\d+) ([-+x*]) (-?\d+) =", view.find(id="math-problem").text))
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return [type_into(view.find("input", id="math-answer"), str(value)), submit(view)]


@solves("simple-algebra")
def _simple_algebra(view: View) -> list[Call]:
    problem = view.find(id="math-problem").text.replace(" ", "")
    left, right = problem.split("=")
    total = int(right)
    # "a + x", "x + a", "a - x" or "x - a" on the left.
    match = _need(re.fullmatch(r"(-?\d+)([-+])x|x([-+])(-?\d+)", left))
    if match.group(1) is not None:
        a = int(match.group(1))
        value = total - a if match.group(2) == "+" else a - total
    else:
        b = int(match.group(4))
        value = total - b if match.group(3) == "+" else total + b
    return [type_into(view.find("input", id="math-answer"), str(value)), submit(view)]


@solves("find-word")
def _find_word(view: View) -> list[Call]:
    match = _need(re.search(r"(\d+)(st|nd|rd|th) word", view.utterance))
    words = view.find("p").text.split()
    word = re.sub(r"[^a-zA-Z0-9]", "", words[int(match.group(1)) - 1])
    return [type_into(view.find("input", id="answer-input"), word), submit(view)]


@solves("odd-or-even")
def _odd_or_even(view: View) -> list[Call]:
    calls = []
    for row in view.all("div", cls="row"):
        nested = view.children(row)
        number = int(next(e.text for e in nested if "display-number" in str(e.attrs.get("class"))))
        calls.append(
            click(
                next(
                    e
                    for e in nested
                    if e.tag == "button" and e.text == ("Even" if number % 2 == 0 else "Odd")
                )
            )
        )
    return [*calls, click(view.find("button", "Submit"))]


@solves("identify-shape")
def _identify_shape(view: View) -> list[Call]:
    shape = view.children(view.find("svg"))[0]
    if shape.tag == "text":
        answer = "Number" if shape.text.isdigit() else "Letter"
    else:
        answer = {"circle": "Circle", "rect": "Rectangle", "polygon": "Triangle"}[shape.tag]
    return [click(view.find("button", answer))]


@solves("copy-paste", "copy-paste-2")
def _copy_paste(view: View) -> list[Call]:
    areas = view.all("textarea")
    match = re.search(r"(\d)(st|nd|rd|th) text area", view.utterance)
    source = areas[int(match.group(1)) - 1] if match else areas[0]
    text = str(source.attrs["value"])
    return [type_into(view.find("input", id="answer-input"), text), submit(view)]


@solves("multi-orderings", "multi-layouts")
def _multi_orderings(view: View) -> list[Call]:
    match = _need(
        re.match(r"Search for (.*) movies directed by (.*) from year (\d+)", view.utterance)
    )
    values = {"genre": match.group(1), "director": match.group(2), "year": match.group(3)}
    calls = [type_into(_field_for(view, label), value) for label, value in values.items()]
    button = next(e for e in view.elements if e.text.strip().lower() in ("submit", "search", "go!"))
    return [*calls, click(button)]


_FIELD_WORDS = {"genre": ("genre",), "director": ("director",), "year": ("year", "date")}


def _field_for(view: View, label: str) -> Element:
    """The text field a form labels `label`: by placeholder, or the first after its label."""
    for element in view.inputs():
        if any(w in str(element.attrs.get("placeholder", "")).lower() for w in _FIELD_WORDS[label]):
            return element
    words = _FIELD_WORDS[label]
    for index, element in enumerate(view.elements):
        if element.tag in ("input", "textarea") or not any(
            w in element.text.lower() for w in words
        ):
            continue
        parent = next(e for e in reversed(view.elements[:index]) if e.depth < element.depth)
        beside = [e for e in view.children(parent) if e.tag in ("input", "textarea")]
        if len(beside) == 1:
            return beside[0]
        return next(e for e in view.elements[index:] if e.tag in ("input", "textarea"))
    raise LookupError(f"no field labelled {label!r}")


@solves("navigate-tree")
def _navigate_tree(view: View) -> list[Call]:
    targets = view.all("span", view.quoted())
    if targets:
        return [click(targets[0])]
    closed = [e for e in view.elements if "expandable-hitarea" in str(e.attrs.get("class"))]
    return [click(closed[0])]


@solves("sign-agreement")
def _sign_agreement(view: View) -> list[Call]:
    if "cancel button" in view.utterance:
        return [click(view.find("button", "Cancel"))]
    area = view.find("textarea")
    name = view.find("input", id="name")
    if name.attrs.get("disabled"):
        return [("scroll", {"direction": "down", "amount": 5000, "element": area.id})]
    return [type_into(name, view.quoted(0)), click(view.find("button", view.quoted(1)))]


@solves("use-autocomplete", "use-autocomplete-nodelay")
def _use_autocomplete(view: View) -> list[Call]:
    quoted = re.findall(r'"([^"]*)"', view.utterance)
    start, end = quoted[0], quoted[1] if len(quoted) > 1 else ""
    choices = [e for e in view.all("div") if e.text.startswith(start) and e.text.endswith(end)]
    if view.turn == 0:
        return [type_into(view.find("input", id="tags"), start)]
    if not choices:  # the suggestions show after the widget's delay
        return [("wait", {"seconds": 0.5})]
    return [click(choices[0]), submit(view)]


class ScriptedGUIAgent:
    """Plays one MiniWoB++ task with its scripted solver, from observations only."""

    def __init__(self, task_name: str):
        self.solver = SOLVERS[task_name]
        self.turn = 0
        self.last_view = ""

    def act(self, observation: list[Message], info: dict[str, Any]) -> Action:
        view_text = next(
            (m["content"] for m in reversed(observation) if _is_page_view(m)), self.last_view
        )
        if isinstance(view_text, list):
            view_text = next(part["text"] for part in view_text if part.get("type") == "text")
        if "task_id" in info and info.get("turn") is None:
            self.turn = 0
        self.last_view = view_text
        utterance, elements = parse_rendering(view_text)
        calls = self.solver(View(utterance, tuple(elements), self.turn))
        self.turn += 1
        return tool_calls_message(calls, id_prefix=f"call_{self.turn}")


def _is_page_view(message: Message) -> bool:
    content = message.get("content")
    if message.get("role") != "user" or content is None:
        return False
    text = content if isinstance(content, str) else json.dumps(content)
    return "Page:" in text
