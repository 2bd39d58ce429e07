"""One environment's browser: an isolated Playwright context with one MiniWoB++ task page.

What a `TaskPage` isolates, and how:
- Network: every request of the context is intercepted. Requests for the task origin
  (`http://miniwob.clawgym.invalid/`, a name that cannot resolve) are answered from the
  files of the installed `miniwob` package; every other request, navigation and WebSocket
  is refused and counted in `blocked` (a navigation gets "204 No Content", so the frame
  stays on its task page). No server listens anywhere, and Chromium's resolver
  resolves nothing (see `envs.gui.browser.CHROMIUM_ARGS`).
- State: each environment has its own browser context (cookies, storage, cache; service
  workers are blocked). Between episodes of one env, a page is loaded afresh when the task
  changes or keeps state, else restarted in place (`GUIEnv(reuse_page=...)`).
- Timing: a page's own clock runs in real time; nothing here freezes it.
- Downloads are refused; pop-up windows are closed as they open.

What it does not isolate: the contexts share one Chromium process tree, its CPU and its
memory; a renderer that crashes is this environment's loss, a browser that crashes is
every environment's in the process (each then ends its episode and starts over).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import mimetypes
import posixpath
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import miniwob
from playwright.async_api import (
    BrowserContext,
    CDPSession,
    FloatRect,
    Page,
    Route,
    ViewportSize,
    WebSocketRoute,
)
from playwright.async_api import Error as PlaywrightError

from envs.gui.browser import BrowserHost
from envs.gui.scripts import INIT_SCRIPT

log = logging.getLogger(__name__)
T = TypeVar("T")

ORIGIN = "http://miniwob.clawgym.invalid"
# MiniWoB++'s window and the task area inside it (miniwob.constants).
WINDOW: ViewportSize = {"width": 500, "height": 320}
TASK_AREA: FloatRect = {"x": 0, "y": 0, "width": 160, "height": 210}
# setTimeout's largest delay (2**31 - 1 ms, about 24.8 days): "no time limit" to a page.
NO_TIME_LIMIT_MS = 2**31 - 1
_BLOCKED_KEPT = 100
_SETTLE_SECONDS = 2.0
_GRACE_SECONDS = 0.025


@functools.cache
def html_root() -> Path:
    """MiniWoB++'s `html` folder inside the installed `miniwob` package."""
    return (Path(miniwob.__file__).parent / "html").resolve()


@functools.cache
def read_page_file(path: str) -> tuple[bytes, str] | None:
    """Body and content type of a file under `html_root()`, or None if there is none.

    `path` is a URL path; one that climbs out of the folder gets None.
    """
    relative = posixpath.normpath(unquote(path)).lstrip("/")
    if relative.startswith(".."):
        return None
    file = (html_root() / relative).resolve()
    if not file.is_relative_to(html_root()) or not file.is_file():
        return None
    kind = mimetypes.guess_type(file.name)[0] or "application/octet-stream"
    if kind.startswith("text/") or kind == "application/javascript":
        kind += "; charset=utf-8"
    return file.read_bytes(), kind


@dataclass(frozen=True)
class PageConfig:
    """How a task page is shown."""

    scale: float = 1.0
    """Device pixels per CSS pixel of screenshots."""


class TaskPage:
    """A browser context with one page, on a `BrowserHost`'s loop; all methods are
    coroutines to run there (see the module docstring for what it isolates)."""

    def __init__(self, host: BrowserHost, config: PageConfig):
        self.host = host
        self.config = config
        self.blocked = 0
        self.blocked_urls: list[str] = []
        self.crashed = False
        self.loaded: str | None = None
        self.pending = 0  # task-page requests being answered
        self.requests = 0  # task-page requests answered or being answered, ever
        # Whether starting an episode on this page fetches files: None until one has
        # started since the page loaded, then True for good once one has (see `begin`).
        self.fetches: bool | None = None
        self._last_request = 0.0
        self._context: BrowserContext | None = None
        self._page: Page | None = None
        self._cdp: CDPSession | None = None
        self._gone: asyncio.Future[None] | None = None

    @property
    def page(self) -> Page:
        if self._page is None:
            raise RuntimeError("the task page is not open")
        return self._page

    @property
    def alive(self) -> bool:
        browser = self._context.browser if self._context is not None else None
        return (
            not self.crashed
            and self._page is not None
            and not self._page.is_closed()
            and browser is not None
            and browser.is_connected()
        )

    async def open(self) -> None:
        browser = await self.host.browser()
        context = await browser.new_context(
            viewport=WINDOW,
            device_scale_factor=self.config.scale,
            accept_downloads=False,
            service_workers="block",
            locale="en-US",
            timezone_id="UTC",
        )
        self._context = context
        await context.add_init_script(INIT_SCRIPT)
        await context.route("**/*", self._route)
        await context.route_web_socket("**/*", self._route_web_socket)
        context.on("page", self._on_page)
        self._gone = asyncio.get_running_loop().create_future()
        self._page = await context.new_page()
        self._page.on("crash", self._on_crash)
        self._page.on("close", self._on_close)
        # `call` speaks to the page through its own DevTools session: `page.evaluate`
        # wraps every call in Playwright's utility script and its value serialiser, which
        # cost about 2.5x the CPU of a plain `Runtime.evaluate` returning one JSON string
        # (measured on an observation: 6.3 vs 2.5 ms over Python, driver and browser).
        self._cdp = await context.new_cdp_session(self._page)

    async def close(self) -> None:
        context, self._context, self._page, self._cdp = self._context, None, None, None
        self.loaded = None
        if context is not None:
            try:
                await context.close()
            except Exception as error:  # a crashed browser takes its contexts with it
                log.debug("closing a browser context: %s", error)

    async def load(self, page_path: str) -> None:
        """Loads a task page afresh (MiniWoB's `window.onload` shows its sync screen)."""
        await self.page.goto(f"{ORIGIN}/{page_path}", wait_until="load")
        self.loaded = page_path
        self.fetches = None

    async def call(self, function: str, *args: Any) -> Any:
        """Calls `window.__clawgym.<function>(*args)` in the page and returns its
        (awaited) result, which must be JSON.

        Raises:
            playwright.async_api.Error: if the call throws or the page is gone.
        """
        cdp, gone = self._cdp, self._gone
        if cdp is None or gone is None:
            raise RuntimeError("the task page is not open")
        # JSON is also JavaScript, so the arguments go into the expression as they are,
        # and the result comes back as one string for json.loads.
        expression = (
            f"Promise.resolve(window.__clawgym.{function}(...{json.dumps(list(args))}))"
            ".then((value) => JSON.stringify(value === undefined ? null : value))"
        )
        reply = await _unless(
            gone,
            cdp.send(
                "Runtime.evaluate",
                {"expression": expression, "awaitPromise": True, "returnByValue": True},
            ),
        )
        if "exceptionDetails" in reply:
            details = reply["exceptionDetails"]
            thrown = details.get("exception", {}).get("description") or details.get("text")
            raise PlaywrightError(f"{function}: {thrown}")
        return json.loads(reply["result"]["value"])

    async def begin(
        self, seed: int, mode: str, episode_ms: float, quiet: bool = False
    ) -> dict[str, Any]:
        """Starts an episode as MiniWoB's driver does and observes its first page.

        Starting lays the new problem out, which makes some pages fetch what they show
        (images of CSS `content`, say, which give elements their size); once those have
        arrived the page is seen whole, so an episode's first observation depends on its
        task and seed only, not on timing. The page itself waits for its <img>s; files
        fetched otherwise are waited for here, by a grace period (`quiet`), on a page just
        loaded, on one where any episode has fetched files, when `quiet` is asked for
        (pixels depend on every file), and whenever one is seen arriving. A page whose
        episodes have fetched nothing skips the grace period: it needs only one call.

        Returns:
            `{"problem": str}` if the page could not start an episode, else `{"problem":
            None, "view": raw observation}`.
        """
        requests = self.requests
        if quiet or self.fetches is not False:
            problem = await self.call("start", seed, mode, episode_ms)
            if problem:
                return {"problem": problem}
            await self.quiet()
            self.fetches = bool(self.fetches) or self.requests != requests
            return {"problem": None, "view": await self.call("observe", 2)}
        started = dict(await self.call("begin", seed, mode, episode_ms))
        if started["problem"] is None and (self.pending or self.requests != requests):
            self.fetches = True
            await self.quiet()
            # Ids are handed out as elements are first seen; the first look saw a page
            # still loading, so numbering starts again.
            started["view"] = await self.call("observe", 2, True)
        return started

    async def observe(self, settle: int = 1) -> dict[str, Any]:
        """The page once the last action has taken effect: zero-delay timers run (and with
        `settle=2` a frame rendered and its images loaded), and the files the page asked
        for meanwhile (images of new elements, say) delivered."""
        raw = await self.call("observe", settle)
        if self.pending:
            await self.quiet()
            raw = await self.call("observe", 2)
        return dict(raw)

    async def quiet(self) -> None:
        """Waits until no task-page request is being answered and none has arrived for a
        short grace period (requests the page issued just now may still be on their way
        to `_route`), for at most a few seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _SETTLE_SECONDS
        await asyncio.sleep(_GRACE_SECONDS)
        while loop.time() < deadline and (
            self.pending or loop.time() - self._last_request < _GRACE_SECONDS
        ):
            await asyncio.sleep(0.005)

    async def park_mouse(self) -> None:
        """Moves the pointer off the task area, so no hover state carries into an episode."""
        await self.page.mouse.move(WINDOW["width"] - 1, WINDOW["height"] - 1)

    async def screenshot(self) -> bytes:
        return await self.page.screenshot(clip=TASK_AREA, type="png", caret="hide")

    async def _route(self, route: Route) -> None:
        url = route.request.url
        if url.startswith(ORIGIN + "/"):
            self.pending += 1
            self.requests += 1
            self._last_request = asyncio.get_running_loop().time()
            try:
                found = read_page_file(urlsplit(url).path)
                if found is None:
                    await route.fulfill(status=404, body=b"", content_type="text/plain")
                else:
                    await route.fulfill(status=200, body=found[0], content_type=found[1])
            finally:
                self.pending -= 1
            return
        self._count_blocked(url)
        if route.request.is_navigation_request():
            # "No Content" keeps the frame on its task page; an abort would show an error page.
            await route.fulfill(status=204, body=b"")
        else:
            await route.abort("blockedbyclient")

    async def _route_web_socket(self, socket: WebSocketRoute) -> None:
        # Not connecting it to a server is what blocks it.
        self._count_blocked(socket.url)
        await socket.close(code=1008, reason="blocked by clawgym")

    def _count_blocked(self, url: str) -> None:
        self.blocked += 1
        if len(self.blocked_urls) < _BLOCKED_KEPT:
            self.blocked_urls.append(url)
        log.debug("blocked %s", url)

    async def _on_page(self, page: Page) -> None:
        if page is not self._page and self._page is not None:
            await page.close()

    def _on_crash(self, page: Page) -> None:
        log.warning("the renderer of %s crashed", self.loaded)
        self.crashed = True
        self._on_close(page)

    def _on_close(self, page: Page) -> None:
        if self._gone is not None and not self._gone.done():
            self._gone.set_result(None)


async def _unless(gone: asyncio.Future[None], request: Coroutine[Any, Any, T]) -> T:
    """Awaits a DevTools request, failing as soon as `gone` is set (the page crashed or
    closed): a session's pending request is never answered once its renderer crashed."""
    sent = asyncio.ensure_future(request)
    await asyncio.wait((sent, gone), return_when=asyncio.FIRST_COMPLETED)
    if not sent.done():
        sent.cancel()
        raise PlaywrightError("the task page crashed or closed")
    return sent.result()
