"""The house rules of docs/architecture.md, checked on the source: imports point down the
layers, modules and functions stay a readable size, and no docstring points outside the
repository for its design."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("envs", "agents", "trainers", "benchmarks", "examples")
# What each package may import of clawgym's own (docs/architecture.md, "Layers").
MAY_IMPORT = {
    "envs": {"envs"},
    "agents": {"envs", "agents"},
    "trainers": {"envs", "agents", "trainers"},
    "benchmarks": {"envs", "agents", "trainers", "benchmarks"},
    "examples": {"envs", "examples"},
}
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def imported_packages(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & set(PACKAGES)


def test_imports_point_down_the_layers():
    upward = []
    for path in sources():
        package = path.relative_to(ROOT).parts[0]
        above = imported_packages(ast.parse(path.read_text())) - MAY_IMPORT[package]
        upward += [f"{path.relative_to(ROOT)} imports {name}" for name in sorted(above)]
    assert not upward, upward


def test_engines_know_nothing_of_http_serving():
    engines = sorted((ROOT / "agents" / "engines").rglob("*.py"))
    serving = [str(p.relative_to(ROOT)) for p in engines if "agents.serving" in p.read_text()]
    assert not serving, serving


def test_no_module_is_over_500_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in sources()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, long


def test_no_function_is_over_60_lines():
    long = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.name} {lines}")
    assert not long, long


@pytest.mark.parametrize("suffix", [".py", ".md"])
def test_nothing_points_to_design_notes_outside_the_repository(suffix):
    paths = [p for p in ROOT.rglob(f"*{suffix}") if not _ignored(p)]
    notes = ("DESIGN.md", "REFERENCE.md", "shared/")
    outside = [str(p.relative_to(ROOT)) for p in paths if any(n in p.read_text() for n in notes)]
    assert not outside, outside


def _ignored(path: Path) -> bool:
    parts = path.relative_to(ROOT).parts
    return parts[0].startswith(".") or parts[0] in {"runs", "outputs", "build", "tests"}
