"""The leaderboard page in headless Debian Chromium (Playwright, never `playwright install`):
it renders offline, shows every policy and both plots, and its table sorts.

The screenshot goes to `$CLAWGYM_SCREENSHOT` when set, else beside the test's page."""

import os
from pathlib import Path

import pytest

from benchmarks.leaderboard.config import BenchConfig, SamplingConfig
from benchmarks.run import benchmark
from tests.benchmarks.test_leaderboard import make_run

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    """A real leaderboard: the baselines and a run's adapters at every step, on Arith."""
    root = tmp_path_factory.mktemp("board")
    run_dir = make_run(root / "demo-run")
    return benchmark(
        BenchConfig(
            suite="arith/test",
            limit=3,
            policy=[f"adapter:{run_dir}@all"],
            sampling=SamplingConfig(max_tokens=8),
            out_dir=str(root / "out"),
        )
    )


@pytest.fixture(scope="module")
def page(board):
    from playwright.sync_api import sync_playwright

    from envs.gui.browser import CHROMIUM_ARGS, chromium_path

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        tab = browser.new_page(viewport={"width": 1400, "height": 1000})
        requested: list[str] = []
        tab.on("request", lambda request: requested.append(request.url))
        tab.goto(board.html.resolve().as_uri())
        tab.requested = requested
        yield tab
        browser.close()


def test_the_page_renders_offline_with_every_policy_and_both_plots(board, page, tmp_path):
    assert all(url.startswith("file://") for url in page.requested), page.requested
    rows = page.locator("table.board tbody tr")
    assert rows.count() == len(board.results)
    shown = {rows.nth(i).get_attribute("data-policy") for i in range(rows.count())}
    assert (
        shown
        == {r.policy for r in board.results}
        == {
            "do-nothing",
            "oracle",
            "demo-run@0",
            "demo-run@1",
            "demo-run@2",
        }
    )
    for plot in ("reward", "curve"):
        figure = page.locator(f"figure[data-plot='{plot}'] svg")
        assert figure.count() == 1 and figure.bounding_box()["height"] > 100
    target = Path(os.environ.get("CLAWGYM_SCREENSHOT") or board.html.with_name("screenshot.png"))
    page.screenshot(path=str(target), full_page=True)
    assert target.stat().st_size > 10_000


def test_clicking_a_header_sorts_the_table_both_ways(page):
    def column(index):
        cells = page.locator(f"table.board tbody tr td:nth-child({index + 1})")
        return [cells.nth(i).get_attribute("data-sort") for i in range(cells.count())]

    headers = page.locator("table.board th")
    labels = [headers.nth(i).inner_text().strip() for i in range(headers.count())]
    success = labels.index("success (pass@1)")
    policy = labels.index("policy")

    headers.nth(success).click()
    values = [float(v) for v in column(success)]
    assert values == sorted(values) and values[0] < values[-1]
    assert headers.nth(success).get_attribute("aria-sort") == "ascending"
    headers.nth(success).click()
    assert [float(v) for v in column(success)] == sorted(values, reverse=True)

    headers.nth(policy).click()
    names = column(policy)
    assert names == sorted(names)
    assert page.locator("table.board tbody tr").first.get_attribute("data-policy") == names[0]
