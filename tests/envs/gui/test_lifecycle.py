"""The browser's life cycle: one Chromium per process shared by its envs, recovery after a
crash, and nothing left running after the last close. No other env may be open while these
run, so they live apart from the module-scoped env of test_env.py."""

import asyncio
import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest

from envs.core import run_episode
from envs.gui.browser import BrowserCrashed, acquire_host, release_host
from envs.gui.env import GUIEnv
from envs.gui.solvers import ScriptedGUIAgent
from tests.envs.gui.conftest import call, chromium_browser_pids, kill
from tests.envs.gui.test_env import button_centre

pytestmark = pytest.mark.browser


def test_envs_in_one_process_share_one_browser_and_run_concurrently():
    host = acquire_host()
    try:
        envs = [GUIEnv(tasks=["click-checkboxes", "enter-password"]) for _ in range(4)]
        rewards: list[float] = []

        def play(env: GUIEnv, seed: int) -> None:
            _, info = env.reset(seed=seed)
            agent = ScriptedGUIAgent(info["task_id"].split("/")[1])
            rewards.append(run_episode(env, agent, task_id=info["task_id"], seed=seed).total_reward)

        threads = [threading.Thread(target=play, args=(env, i)) for i, env in enumerate(envs)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert rewards == [1.0] * 4
        assert host.users == 5 and host.launches == 1 and len(chromium_browser_pids()) == 1
        for env in envs:
            env.close()
            env.close()  # idempotent
        assert host.users == 1 and host.running
    finally:
        release_host(host)
    assert not host.running and chromium_browser_pids() == []


def test_a_browser_crash_truncates_the_episode_and_the_next_reset_recovers():
    env = GUIEnv(tasks=["click-test"])
    try:
        env.reset(seed=0)
        (browser,) = chromium_browser_pids()
        kill(browser)
        observation, reward, terminated, truncated, info = env.step(call("click", element=4))
        assert (reward, terminated, truncated, info["browser_crashed"]) == (0.0, False, True, True)
        assert "browser failed" in observation[0]["content"]
        observation, info = env.reset(seed=0)
        assert "browser_crashed" not in info and env._host.launches == 2
        assert (
            env.step(call("click_at", x=button_centre(env)[0], y=button_centre(env)[1]))[1] == 1.0
        )
    finally:
        env.close()
        env.close()
    assert chromium_browser_pids() == []


def test_a_renderer_crash_fails_a_pending_page_call_at_once():
    # A DevTools session never answers a request its crashed renderer was running; the
    # call must fail with the crash, not wait out the env's time limit.
    env = GUIEnv(tasks=["click-test"], timeout=20.0)
    try:
        env.reset(seed=0)
        page = env._page

        async def crash_during_call() -> None:
            await page.page.evaluate(
                "() => { window.__clawgym.hang = () => new Promise(() => {}); }"
            )
            hanging = asyncio.ensure_future(env._guard(page.call("hang")))
            await asyncio.sleep(0.2)
            crasher = await page._context.new_cdp_session(page.page)
            asyncio.ensure_future(crasher.send("Page.crash"))
            await hanging

        started = time.monotonic()
        with pytest.raises(BrowserCrashed):
            env._run(crash_during_call())
        assert time.monotonic() - started < 10
        assert env.step(call("wait", seconds=0))[-1]["browser_crashed"] is True
        assert env.reset(seed=1)[0][1]["content"].startswith("Task: ")
    finally:
        env.close()


def test_our_disabled_features_keep_every_one_playwright_disables():
    # Chromium keeps the last --disable-features switch only: ours, after Playwright's.
    env = GUIEnv(tasks=["click-test"])
    try:
        env.reset(seed=0)
        (browser,) = chromium_browser_pids()
        arguments = Path(f"/proc/{browser}/cmdline").read_bytes().decode().split("\0")
        lists = [
            a.split("=", 1)[1].split(",") for a in arguments if a.startswith("--disable-features=")
        ]
        assert len(lists) >= 2 and "DeferRendererTasksAfterInput" in lists[-1]
        assert set(lists[0]) <= set(lists[-1])
    finally:
        env.close()


def test_close_before_any_reset_and_reset_after_close_work():
    env = GUIEnv(tasks=["click-test"])
    env.close()
    observation, _ = env.reset(seed=0)
    assert observation[1]["content"].startswith("Task: Click the button.")
    env.close()
    assert chromium_browser_pids() == []


def _play_in_child(queue) -> None:
    env = GUIEnv(tasks=["click-test"])
    try:
        env.reset(seed=0)
        reward = env.step(call("click_at", x=button_centre(env)[0], y=button_centre(env)[1]))[1]
        queue.put((reward, env._host.pid == os.getpid()))
    finally:
        env.close()


def test_a_forked_worker_process_gets_its_own_browser():
    parent = GUIEnv(tasks=["click-test"])
    try:
        parent.reset(seed=0)  # the parent's browser thread is running when it forks
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        child = context.Process(target=_play_in_child, args=(queue,))
        child.start()
        assert queue.get(timeout=120) == (1.0, True)
        child.join(60)
        assert child.exitcode == 0
        assert (
            parent.step(call("click_at", x=button_centre(parent)[0], y=button_centre(parent)[1]))[1]
            == 1.0
        )
    finally:
        parent.close()
