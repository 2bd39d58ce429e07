"""What the agent sees of a task page: its instruction and a compact text rendering of the
visible elements, each with the id the action tools take, and optionally a screenshot.

A rendered line looks like

    [7] button "Submit"
      [8] input type=text value="hello" focused

one element per line, indented by depth in the visible tree (an invisible wrapper adds no
depth), then its tag, its own text in quotes and its attributes. `parse_rendering` reads
such lines back, which is what the scripted solvers do.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass, field
from typing import Any

from envs.core import Message

_LINE = re.compile(
    r'^(?P<indent> *)\[(?P<id>\d+)\] (?P<tag>[\w:-]+)(?: (?P<text>"(?:[^"\\]|\\.)*"))?'
)
_ATTRIBUTE = re.compile(r' (?P<key>[\w-]+)(?:=(?P<value>"(?:[^"\\]|\\.)*"|\S+))?')


@dataclass(frozen=True)
class Element:
    """One visible element as rendered: id, depth, tag, own text, attributes."""

    id: int
    depth: int
    tag: str
    text: str
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PageView:
    """The page as observed after an action."""

    utterance: str
    elements: tuple[Element, ...]
    done: bool
    reward: float
    reason: str | None


def view_from_js(raw: dict[str, Any]) -> PageView:
    """Builds a `PageView` from what `window.__clawgym.observe` returns."""
    elements = tuple(
        Element(int(i), int(depth), str(tag), str(text), dict(attrs))
        for i, depth, tag, text, attrs in raw["nodes"]
    )
    state = raw["state"]
    return PageView(
        utterance=str(raw["utterance"]),
        elements=elements,
        done=bool(state["done"]),
        reward=float(state["reward"]),
        reason=state["reason"],
    )


def _attribute(key: str, value: Any) -> str:
    if value is True:
        return key
    if value is False:
        return f"{key}=false"
    text = str(value)
    return (
        f"{key}={json.dumps(text)}"
        if key == "value" or not re.fullmatch(r"\S+", text)
        else f"{key}={text}"
    )


def render_element(element: Element) -> str:
    parts = [f"{'  ' * element.depth}[{element.id}] {element.tag}"]
    if element.text:
        parts.append(json.dumps(element.text, ensure_ascii=False))
    parts += [_attribute(key, value) for key, value in element.attrs.items()]
    return " ".join(parts)


def render_page(view: PageView) -> str:
    """The text the agent reads: instruction, then one line per visible element."""
    lines = [f"Task: {view.utterance}", "Page:"]
    lines += [render_element(element) for element in view.elements]
    return "\n".join(lines)


def page_message(view: PageView, screenshot: bytes | None = None, elements: bool = True) -> Message:
    """A user message with the rendered page (only its instruction without `elements`)
    and, when given, a PNG screenshot as an image part in the OpenAI multimodal format."""
    text = render_page(view) if elements else f"Task: {view.utterance}"
    if screenshot is None:
        return {"role": "user", "content": text}
    url = "data:image/png;base64," + base64.b64encode(screenshot).decode("ascii")
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": url}},
        ],
    }


def parse_rendering(text: str) -> tuple[str, list[Element]]:
    """Reads a rendering back into its instruction and elements (attributes as strings,
    bare flags as True)."""
    utterance, elements = "", []
    for line in text.splitlines():
        if line.startswith("Task: "):
            utterance = line[len("Task: ") :]
            continue
        match = _LINE.match(line)
        if match is None:
            continue
        text_part = match.group("text")
        attrs: dict[str, Any] = {}
        for attribute in _ATTRIBUTE.finditer(line[match.end() :]):
            value = attribute.group("value")
            if value is None:
                attrs[attribute.group("key")] = True
            else:
                attrs[attribute.group("key")] = (
                    json.loads(value) if value.startswith('"') else value
                )
        elements.append(
            Element(
                id=int(match.group("id")),
                depth=len(match.group("indent")) // 2,
                tag=match.group("tag"),
                text=json.loads(text_part) if text_part else "",
                attrs=attrs,
            )
        )
    return utterance, elements
