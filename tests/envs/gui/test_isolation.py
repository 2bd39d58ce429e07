"""What the browser can reach: the task pages and nothing else. Requests are made from
inside the page (the only place a request can come from), with test-only access to it."""

import pytest

from envs.gui.env import GUIEnv
from envs.gui.page import ORIGIN
from tests.envs.gui.conftest import call

pytestmark = pytest.mark.browser


def in_page(env: GUIEnv, script: str):
    """Runs `script` (an async function body) inside env's task page."""
    return env._run(env._page.page.evaluate(f"async () => {{ {script} }}"))


@pytest.fixture(scope="module")
def pair():
    envs = GUIEnv(tasks=["click-test"]), GUIEnv(tasks=["click-test"])
    for env in envs:
        env.reset(seed=0)
    yield envs
    for env in envs:
        env.close()


def test_requests_off_the_task_origin_are_blocked_and_counted(pair):
    env = pair[0]
    env.reset(seed=1)
    outcome = in_page(
        env,
        """
        const results = [];
        for (const url of ['http://example.com/x', 'https://1.1.1.1/', 'http://127.0.0.1:9/']) {
          try { await fetch(url); results.push('reached'); } catch (e) { results.push('failed'); }
        }
        const img = new Image();
        await new Promise((r) => {
          img.onerror = r; img.onload = r; img.src = 'https://example.org/a.png';
        });
        return results;
        """,
    )
    assert outcome == ["failed"] * 3
    info = env.step(call("wait", seconds=0))[-1]
    assert info["blocked_requests"] == 4
    assert env._page.blocked_urls[-4:] == [
        "http://example.com/x",
        "https://1.1.1.1/",
        "http://127.0.0.1:9/",
        "https://example.org/a.png",
    ]
    # The count is per episode.
    assert env.reset(seed=1)[1]["blocked_requests"] == 0


def test_websockets_navigation_and_popups_are_blocked_too(pair):
    env = pair[0]
    env.reset(seed=2)
    before = env._page.blocked
    closed = in_page(
        env,
        """
        const ws = new WebSocket('ws://example.com/socket');
        return await new Promise((r) => {
          ws.onclose = () => r(true); ws.onopen = () => r(false);
        });
        """,
    )
    assert closed is True
    in_page(env, "window.open('https://example.com/popup'); return null;")
    in_page(env, "location.href = 'https://example.com/away'; return null;")
    observation, *_ = env.step(call("wait", seconds=0.3))
    assert env._page.blocked - before >= 3
    assert env._page.page.url.startswith(ORIGIN) and len(env._page._context.pages) == 1
    assert observation[-1]["content"].startswith("Task: Click the button.")


def test_task_origin_serves_only_package_files(pair):
    env = pair[0]
    env.reset(seed=3)
    statuses = in_page(
        env,
        """
        const urls = ['/core/core.js', '/miniwob/nothing-here.html', '/../../../etc/passwd'];
        return await Promise.all(urls.map(async (u) => (await fetch(u)).status));
        """,
    )
    assert statuses == [200, 404, 404]


def test_contexts_share_no_state(pair):
    first, second = pair
    in_page(first, "localStorage.setItem('k', 'v'); document.cookie = 'c=1; path=/'; return null;")
    assert in_page(first, "return [localStorage.getItem('k'), document.cookie];") == ["v", "c=1"]
    assert in_page(second, "return [localStorage.getItem('k'), document.cookie];") == [None, ""]
