"""The leaderboard's pages: `leaderboard.md` and a static, self-contained `index.html`.

The HTML page needs nothing from the network (the machines that read it may have none): the
sorting script is inline and the plots are inline SVG drawn by matplotlib. Per suite it
shows one sortable table (click a header; again to reverse) and two plots: score by policy
with 95% intervals for every task set, and success rate across adapter steps for every
training run evaluated at several steps (the learning curve).

Policy, task set and suite names come from whoever ran the benchmark (a run directory's
name, an endpoint's model) and are shown as text everywhere: escaped for markdown and HTML,
and drawn with matplotlib's math markup off, so no name can break a page or the plotting.
"""

from __future__ import annotations

import html
import io
import math
import re
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

Row = dict[str, Any]

COLUMNS: tuple[tuple[str, str], ...] = (
    ("task_set", "task set"),
    ("policy", "policy"),
    ("kind", "kind"),
    ("pass1", "success (pass@1)"),
    ("pass_k", "pass@k"),
    ("score", "score"),
    ("reward", "reward"),
    ("turns", "turns"),
    ("tokens_in", "tokens in"),
    ("tokens_out", "tokens out"),
    ("wall_s", "wall s"),
    ("episodes", "episodes"),
    ("weights_hash", "weights"),
)


def _num(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _cell(row: Row, key: str) -> str:
    if key == "pass1":
        return f"{_num(row['pass1'])} [{_num(row['pass1_lo'])}, {_num(row['pass1_hi'])}]"
    if key in ("score", "reward"):
        return f"{_num(row[key])} [{_num(row[key + '_lo'])}, {_num(row[key + '_hi'])}]"
    if key == "pass_k":
        return f"{_num(row['pass_k'])} (k={row['k']})"
    if key in ("turns", "tokens_in", "tokens_out"):
        return _num(row[key], 1)
    if key == "episodes":
        errors = f", {row['errors']} errors" if row["errors"] else ""
        return f"{row['episodes']} ({row['tasks']} tasks{errors})"
    return _num(row[key]) if isinstance(row[key], float) else str(row[key])


# Characters that mean something inside a markdown table cell or heading: emphasis, code,
# links and images, HTML, the cell separator, strikethrough, a heading's closing hashes.
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]<>|~#])")
# The columns whose values are names someone chose rather than figures.
_NAMED_COLUMNS = frozenset({"policy", "kind", "weights_hash"})


def markdown_text(text: str) -> str:
    """`text` as literal markdown on one line (a table cell holds no line break)."""
    return _MARKDOWN_SPECIAL.sub(r"\\\1", " ".join(str(text).split()))


def markdown_code(text: str) -> str:
    """`text` as an inline code span: the fence is one backtick longer than any run of
    backticks inside it (CommonMark's rule), so the span cannot be closed early."""
    text = " ".join(str(text).split())
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def plot_text(text: str) -> str:
    """`text` as matplotlib draws it literally: an escaped dollar sign starts no math."""
    text = str(text).replace("$", r"\$")
    # a legend skips labels that start with an underscore
    return "\u200b" + text if text.startswith("_") else text


def by_suite(rows: Sequence[Row]) -> dict[str, list[Row]]:
    """Rows grouped by suite, each ranked within its task set (success, then score)."""
    grouped: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        grouped[row["suite"]].append(row)
    return {suite: sorted(r, key=_rank_key) for suite, r in sorted(grouped.items())}


def _rank_key(row: Row) -> tuple[Any, ...]:
    score = row["score"] if row["score"] == row["score"] else -math.inf
    return (row["task_set"], -row["pass1"], -score, row["policy"])


# -- markdown ---------------------------------------------------------------------------
def markdown(rows: Sequence[Row]) -> str:
    """`leaderboard.md`: a ranked table per suite and task set."""
    lines = [
        "# clawgym leaderboard",
        "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')}. Success is pass@1 with a 95% Wilson "
        "interval; score and reward are means with 95% bootstrap intervals (over tasks); "
        "turns and tokens are per episode.",
    ]
    header = [label for key, label in COLUMNS if key != "task_set"]
    for suite, suite_rows in by_suite(rows).items():
        lines += ["", f"## suite {markdown_code(suite)}"]
        for task_set in dict.fromkeys(r["task_set"] for r in suite_rows):
            heading = f"### {markdown_text(task_set)}"
            lines += ["", heading, "", "| # | " + " | ".join(header) + " |"]
            lines.append("|---" * (len(header) + 1) + "|")
            ranked = [r for r in suite_rows if r["task_set"] == task_set]
            for rank, row in enumerate(ranked, 1):
                cells = [_markdown_cell(row, key) for key, _ in COLUMNS if key != "task_set"]
                lines.append(f"| {rank} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _markdown_cell(row: Row, key: str) -> str:
    return markdown_text(_cell(row, key)) if key in _NAMED_COLUMNS else _cell(row, key)


# -- HTML --------------------------------------------------------------------------------
_SCRIPT = """
document.querySelectorAll('table.board').forEach(function (table) {
  table.querySelectorAll('th').forEach(function (th, column) {
    th.addEventListener('click', function () {
      var descending = th.getAttribute('aria-sort') === 'ascending';
      table.querySelectorAll('th').forEach(function (h) { h.removeAttribute('aria-sort'); });
      th.setAttribute('aria-sort', descending ? 'descending' : 'ascending');
      var body = table.tBodies[0];
      var rows = Array.prototype.slice.call(body.rows);
      rows.sort(function (a, b) {
        var x = a.cells[column].dataset.sort, y = b.cells[column].dataset.sort;
        var nx = parseFloat(x), ny = parseFloat(y);
        var order = (isNaN(nx) || isNaN(ny)) ? x.localeCompare(y) : nx - ny;
        return descending ? -order : order;
      });
      rows.forEach(function (row) { body.appendChild(row); });
    });
  });
});
"""

_STYLE = """
body { font-family: sans-serif; margin: 2em; color: #222; }
table.board { border-collapse: collapse; margin: 1em 0; font-size: 13px; }
table.board th, table.board td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; }
table.board td:nth-child(-n+3), table.board th:nth-child(-n+3) { text-align: left; }
table.board th { background: #f0f0f0; cursor: pointer; user-select: none; }
th[aria-sort=ascending]::after { content: " \\25B2"; }
th[aria-sort=descending]::after { content: " \\25BC"; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; }
.plots figure { margin: 0; }
"""


def _sort_value(row: Row, key: str) -> str:
    value = row[key]
    if isinstance(value, float) and math.isnan(value):
        return "-1e308"
    return str(value)


def page(rows: Sequence[Row]) -> str:
    """`index.html`: the whole leaderboard, self-contained."""
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<title>clawgym leaderboard</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>clawgym leaderboard</h1>",
        f"<p>Generated {html.escape(time.strftime('%Y-%m-%d %H:%M:%S'))}. Success is pass@1 "
        "with a 95% Wilson interval; score and reward are means with 95% bootstrap intervals. "
        "Click a column header to sort.</p>",
    ]
    for suite, suite_rows in by_suite(rows).items():
        parts.append(f"<section data-suite='{html.escape(suite)}'>")
        parts.append(f"<h2>suite <code>{html.escape(suite)}</code></h2>")
        parts.append(_table(suite_rows))
        parts.append("<div class='plots'>")
        parts.append(_figure("score by policy (95% CI)", reward_plot(suite_rows), "reward"))
        curve = learning_curve_plot(suite_rows)
        if curve is not None:
            parts.append(_figure("learning curve: success across adapter steps", curve, "curve"))
        parts.append("</div></section>")
    parts.append(f"<script>{_SCRIPT}</script></body></html>")
    return "\n".join(parts)


def _table(rows: Sequence[Row]) -> str:
    head = "".join(f"<th data-key='{key}'>{html.escape(label)}</th>" for key, label in COLUMNS)
    body = []
    for row in rows:
        cells = "".join(
            f"<td data-sort='{html.escape(_sort_value(row, key))}'>"
            f"{html.escape(_cell(row, key))}</td>"
            for key, _ in COLUMNS
        )
        body.append(f"<tr data-policy='{html.escape(row['policy'])}'>{cells}</tr>")
    return (
        f"<table class='board'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    )


def _figure(caption: str, svg: str, kind: str) -> str:
    return (
        f"<figure class='plot' data-plot='{kind}'>{svg}<figcaption>{caption}</figcaption></figure>"
    )


# -- plots -------------------------------------------------------------------------------
def _svg(figure: Any) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight")
    text = buffer.getvalue()
    return text[text.index("<svg") :]  # drop the XML prolog and doctype: inline SVG


def reward_plot(rows: Sequence[Row]) -> str:
    """Horizontal bars of each policy's score with its 95% interval, one panel per task set."""
    from matplotlib.figure import Figure

    task_sets = list(dict.fromkeys(r["task_set"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    figure = Figure(figsize=(4.2 * len(task_sets), 0.45 * len(policies) + 1.2))
    axes = figure.subplots(1, len(task_sets), squeeze=False)[0]
    for ax, task_set in zip(axes, task_sets, strict=True):
        mine = {r["policy"]: r for r in rows if r["task_set"] == task_set}
        names = [p for p in policies if p in mine]
        values = [_finite(mine[p]["score"]) for p in names]
        errors = [
            [v - _finite(mine[p]["score_lo"], v) for p, v in zip(names, values, strict=True)],
            [_finite(mine[p]["score_hi"], v) - v for p, v in zip(names, values, strict=True)],
        ]
        # positions, not the names, on the axis: a categorical axis would parse them as markup
        ax.barh(range(len(names)), values, xerr=errors, color="#4c72b0", capsize=3)
        ax.set_yticks(range(len(names)), labels=[plot_text(n) for n in names])
        ax.invert_yaxis()
        ax.set_title(plot_text(task_set), fontsize=9)
        ax.set_xlabel("score")
    figure.tight_layout()
    return _svg(figure)


def learning_curve_plot(rows: Sequence[Row]) -> str | None:
    """Success (pass@1) against adapter step, one line per training run and task set; None
    when no run was evaluated at two steps or more."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    curves: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    for row in rows:
        if row["series"] is not None and row["step"] is not None:
            curves[(row["series"], row["task_set"])].append((row["step"], row["pass1"]))
    curves = {key: sorted(points) for key, points in curves.items() if len(points) > 1}
    if not curves:
        return None
    figure = Figure(figsize=(5.5, 3.2))
    ax = figure.subplots()
    for (series, task_set), points in sorted(curves.items()):
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, marker="o", label=plot_text(f"{series} · {task_set}"))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("adapter step (0 = base model)")
    ax.set_ylabel("success (pass@1)")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=7)
    figure.tight_layout()
    return _svg(figure)


def _finite(value: Any, default: float = 0.0) -> float:
    return default if value is None or value != value else float(value)
