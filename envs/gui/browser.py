"""One Chromium per process, driven by Playwright's async API from synchronous code.

Gymnasium's `step` and `reset` are synchronous, Playwright's good API is async, and a
browser is too heavy to start per environment. So each process has one `BrowserHost`: an
asyncio event loop on a daemon thread that owns the Playwright driver and one Debian
Chromium. Environments (on any thread of the process) submit coroutines to that loop and
wait for their result with a timeout; several environments share the browser and run
concurrently inside it, each in its own browser context (see `envs.gui.page`).

The host is reference-counted: the first environment to need it starts it, the last one to
close stops the browser, the driver and the thread. A browser that crashed is started
again on the next request for it. A forked child never reuses its parent's host (the
thread does not survive `fork`); it starts its own.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import shutil
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from playwright.async_api import Browser, Playwright, async_playwright

log = logging.getLogger(__name__)
T = TypeVar("T")

# Playwright 1.65's own `--disable-features` list. Chromium keeps only the last
# `--disable-features` switch, and ours comes after Playwright's, so it must repeat them
# (several keep the browser off Google's servers); a test checks it still does.
PLAYWRIGHT_DISABLED_FEATURES = (
    "AvoidUnnecessaryBeforeUnloadCheckSync",
    "DestroyProfileOnBrowserClose",
    "HttpsUpgrades",
    "HttpsFirstBalancedModeAutoEnable",
    "LensOverlay",
    "MediaRouter",
    "PaintHolding",
    "ThirdPartyStoragePartitioning",
    "AvoidCorsURLLoaderRestartOnRedirect",
    "TcpPortRandomizationWin",
    "OptimizationHints",
    "NetworkTimeServiceQuerying",
    "AimEnabled",
    "PreconnectToSearch",
    "msForceBrowserSignIn",
    "msEdgeUpdateLaunchServicesPreferredVersion",
)
# After an input event Chromium defers the page's other tasks, timers included, until the
# next frame (a 60 Hz tick in headless). An observation waits for the page's zero-delay
# timers after every action, so each step paid ~10 ms of that tick (measured: step p50
# 17 -> 7 ms without it). The page still renders at its usual rate; only which of its
# ready tasks runs first changes, as on a busy machine.
DISABLED_FEATURES = (*PLAYWRIGHT_DISABLED_FEATURES, "DeferRendererTasksAfterInput")

# A recipe measured on Debian's Chromium (what starts and renders fastest), plus a
# resolver that resolves nothing: task pages are served by request interception, so no
# host name ever needs an address, and a request that slipped past interception could
# not reach any.
CHROMIUM_ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--disable-features=" + ",".join(DISABLED_FEATURES),
)


class BrowserCrashed(RuntimeError):
    """The browser or a page died, or stopped answering within its time limit."""


def chromium_path() -> str:
    """Debian's Chromium: `$CLAWGYM_CHROMIUM`, else `chromium` on the PATH."""
    path = os.environ.get("CLAWGYM_CHROMIUM") or shutil.which("chromium")
    if not path:
        raise FileNotFoundError(
            "Chromium not found: run scripts/setup.sh as root (it installs Debian's "
            "chromium) or set CLAWGYM_CHROMIUM to a Chromium binary"
        )
    return path


class BrowserHost:
    """An event-loop thread with Playwright and one Chromium; see the module docstring."""

    def __init__(self, executable: str | None = None, args: tuple[str, ...] = CHROMIUM_ARGS):
        self.executable = executable or chromium_path()
        self.args = args
        self.pid = os.getpid()
        self.users = 0
        self.launches = 0
        self._playwright: Playwright | None = None
        self._browser: Browser | None = None
        self._lock: asyncio.Lock | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="clawgym-browser", daemon=True
        )
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._loop.is_closed()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Runs `coro` on the browser thread and returns its result.

        Raises:
            BrowserCrashed: if it takes longer than `timeout` seconds (it is cancelled).
        """
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("BrowserHost.run called from its own thread")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise BrowserCrashed(f"the browser did not answer within {timeout:g} s") from None

    async def browser(self) -> Browser:
        """The shared browser, started (again) if it is not running."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._browser is not None and self._browser.is_connected():
                return self._browser
            if self._browser is not None:
                log.warning("Chromium is gone (crashed or killed); starting it again")
                await self._stop_browser()
            if self._playwright is None:
                self._playwright = await async_playwright().start()
            self._browser = await self._playwright.chromium.launch(
                executable_path=self.executable, args=list(self.args), headless=True
            )
            self.launches += 1
            return self._browser

    async def _stop_browser(self) -> None:
        browser, self._browser = self._browser, None
        if browser is not None:
            try:
                await browser.close()
            except Exception as error:  # a dead browser cannot be closed politely
                log.debug("closing a dead browser: %s", error)

    async def _shutdown(self) -> None:
        await self._stop_browser()
        playwright, self._playwright = self._playwright, None
        if playwright is not None:
            try:
                await playwright.stop()
            except Exception as error:
                log.debug("stopping Playwright: %s", error)

    def close(self, timeout: float = 30.0) -> None:
        """Stops the browser, the driver and the thread; idempotent."""
        if not self.running or os.getpid() != self.pid:
            return
        try:
            self.run(self._shutdown(), timeout)
        except BrowserCrashed:
            log.warning("the browser did not stop within %g s; leaving it to exit", timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._loop.close()


_host_lock = threading.Lock()
_host: BrowserHost | None = None
_atexit_registered = False


def acquire_host() -> BrowserHost:
    """This process's browser host, started if needed; pair with `release_host`."""
    global _host, _atexit_registered
    with _host_lock:
        if _host is None or _host.pid != os.getpid() or not _host.running:
            _host = BrowserHost()
            if not _atexit_registered:
                atexit.register(_close_at_exit)
                _atexit_registered = True
        _host.users += 1
        return _host


def release_host(host: BrowserHost) -> None:
    """Gives back a host from `acquire_host`; the last user's release stops it."""
    global _host
    with _host_lock:
        host.users -= 1
        if host.users > 0:
            return
        if _host is host:
            _host = None
    host.close()


def _close_at_exit() -> None:
    with _host_lock:
        host = _host
    if host is not None:
        host.close(timeout=10.0)
