"""The leaderboard's pages hold whatever names their policies and task sets were given: math
markup for matplotlib, markdown and HTML for the pages, line breaks, the table's own
separator. Each is shown as text and breaks nothing."""

from __future__ import annotations

import html
import re

import pytest

from benchmarks.leaderboard import report

HOSTILE = [
    r"$\frac{1}{$",  # math markup matplotlib cannot parse: it raised
    "a $x$ b",  # balanced math: drawn as math before
    "cut|the|row",
    "<script>alert(1)</script>",
    "**bold** _it_ `code` [link](http://x) ~~gone~~",
    "two\nlines",
    "_hidden_from_legends",
]


def row(policy: str, task_set: str = "arith/test", step: int | None = None) -> dict:
    return {
        "suite": "smoke",
        "task_set": task_set,
        "policy": policy,
        "kind": "model",
        "series": "run" if step is not None else None,
        "step": step,
        "weights_hash": "0123456789abcdef",
        "tasks": 2,
        "episodes": 2,
        "errors": 0,
        "pass1": 0.5,
        "pass1_lo": 0.1,
        "pass1_hi": 0.9,
        "k": 1,
        "pass_k": 0.5,
        "score": 0.5,
        "score_lo": 0.2,
        "score_hi": 0.8,
        "reward": 0.5,
        "reward_lo": 0.2,
        "reward_hi": 0.8,
        "turns": 3.0,
        "tokens_in": 100.0,
        "tokens_out": 10.0,
        "wall_s": 1.5,
    }


def cells(line: str) -> list[str]:
    """A markdown table row's cells, split at separators that are not escaped."""
    return re.split(r"(?<!\\)\|", line.strip())[1:-1]


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_policy_name_is_text_in_the_markdown_table(name):
    text = report.markdown([row(name), row("plain")])
    table = [line for line in text.splitlines() if line.startswith("|")]
    header, _, *body = table
    assert all(len(cells(line)) == len(cells(header)) for line in body), body
    assert "<script>" not in text and "\ntwo" not in text
    shown = next(cells(line)[1].strip() for line in body if "plain" not in line)
    assert re.sub(r"\\(.)", r"\1", shown) == " ".join(name.split())


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_name_draws_and_the_page_escapes_it(name):
    rows = [row(name, task_set=name), row(name, task_set=name, step=1)]
    rows.append(row(name, task_set=name, step=2) | {"series": name, "policy": name + "@2"})
    page = report.page(rows)  # drew every plot: no name is parsed as math
    assert "<script>alert" not in page
    assert html.escape(name) in page


def test_a_suite_name_with_backticks_stays_one_code_span():
    assert report.markdown_code("a`b") == "``a`b``"
    assert report.markdown_code("`x`") == "`` `x` ``"
