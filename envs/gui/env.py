"""`clawgym/GUI-v0`: MiniWoB++'s task pages in a real Chromium, driven through tools.

An episode is one MiniWoB++ task page with one seed. The agent reads the instruction and,
by `observation`, a text rendering of the visible page (`dom`, `envs.gui.render`), a PNG
screenshot of it as an OpenAI `image_url` part (`screenshot`), or both, and acts with tools:
on elements by id (`click`, `type_text`, `select_option`) where it sees the rendering, on
pixels of the screenshot (`click_at`, `type_keys` into what has focus) everywhere, and
`press_key`, `scroll`, `wait`. A screenshot-only agent is shown only the tools it can aim.
After every assistant message it sees the tools' results and then the page again. The
episode ends when the page ends it; the reward is the page's own raw reward
(`WOB_RAW_REWARD_GLOBAL`: 1 for success, -1 for failure, partial credit on a few tasks).
A do-nothing agent runs out of turns with reward 0.

The page's wall-clock limit is off by default: an LLM thinks for seconds per turn, so the
turn budget bounds an episode instead (`episode_seconds` restores MiniWoB's limit).

Browsers: one Chromium per process shared by every env in it, one isolated context per env
(`envs.gui.browser`, `envs.gui.page`). If the browser crashes mid-episode, the episode is
truncated with `info["browser_crashed"]`; the next `reset` starts a new browser.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, Literal, TypeVar

from playwright.async_api import Error as PlaywrightError

from envs.core import AgentEnv, EpisodeAborted, Message, Reply, ScriptedAgent, ToolResult
from envs.gui.browser import BrowserCrashed, BrowserHost, acquire_host, release_host
from envs.gui.page import NO_TIME_LIMIT_MS, TASK_AREA, PageConfig, TaskPage
from envs.gui.pixel_agent import PixelGUIAgent
from envs.gui.render import PageView, page_message, view_from_js
from envs.gui.solvers import SOLVERS, ScriptedGUIAgent
from envs.gui.tasks import GUITask, load_split
from envs.tools import Tool, ToolCallError

log = logging.getLogger(__name__)
T = TypeVar("T")

SYSTEM_PROMPT = (
    "You operate a web page in a browser to complete the task stated at the top of each page "
    'view. The page view lists the visible elements, one per line: [id] tag "text" and '
    "attributes, indented by nesting. Act with the tools: click an element by id, type text "
    "into a field, press a key, select an option of a <select>, scroll, or click at x, y "
    "pixel coordinates of the screenshot, or wait for the page. The episode ends when the "
    "task is done."
)
SCREENSHOT_PROMPT = (
    "You operate a web page in a browser to complete the task stated with each screenshot "
    "of the page. Act with the tools: click at x, y pixel coordinates of the screenshot "
    "(from its top-left corner), type text into whatever has focus (click a field first), "
    "press a key, scroll, or wait for the page. The episode ends when the task is done."
)
Observation = Literal["dom", "screenshot", "both"]
OBSERVATIONS = ("dom", "screenshot", "both")
Direction = Literal["up", "down", "left", "right"]
MAX_WAIT_SECONDS = 5.0
_SCROLL = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}


class GUIEnv(AgentEnv):
    """MiniWoB++ tasks in Chromium (see the module docstring).

    Args:
        split: "train", "test" (held-out task families) or "test_seen" (training families on
            held-out seeds); see `envs.gui.tasks`.
        tasks: task names to draw from, all in `split`; None draws from the whole split.
        max_turns: assistant messages allowed per episode.
        observation: what each page view shows: "dom", the text rendering of its elements;
            "screenshot", a PNG of the task area as an image part of the message (OpenAI
            multimodal format, for a vision-language policy), with only the pixel tools;
            "both".
        screenshot_scale: the screenshot's size, in device pixels per CSS pixel of the
            160 x 210 task area (2: 320 x 420); `click_at` takes screenshot pixels.
        reuse_page: when the next episode is the same task, restart the loaded page in place
            as MiniWoB's own environment does (a reset in tens of milliseconds) instead of
            loading it afresh. Pages that keep state across restarts (`stateful` in the task
            set) are always loaded afresh, and either way an episode is a function of its
            task and seed alone (the gold tests check this for all 130 pages).
        episode_seconds: MiniWoB's wall-clock limit per episode (the page ends it with -1);
            None leaves time to the turn budget.
        timeout: seconds one browser operation may take before the episode is cut off.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        split: str = "train",
        tasks: Sequence[str] | None = None,
        max_turns: int = 12,
        observation: Observation = "dom",
        screenshot_scale: float = 1.0,
        reuse_page: bool = True,
        episode_seconds: float | None = None,
        timeout: float = 30.0,
    ):
        super().__init__(max_turns=max_turns)
        if observation not in OBSERVATIONS:
            raise ValueError(f"observation must be one of {OBSERVATIONS}, got {observation!r}")
        if screenshot_scale <= 0:
            raise ValueError(f"screenshot_scale must be positive, got {screenshot_scale}")
        if episode_seconds is not None and not 0 < episode_seconds * 1000 < NO_TIME_LIMIT_MS:
            raise ValueError("episode_seconds must be positive and below 24 days, or None")
        self.split = split
        self.task_set = load_split(split, tuple(tasks) if tasks is not None else None)
        self.tasks = self.task_set.by_id()
        self.observation = observation
        self.screenshot = observation != "dom"
        self.reuse_page = reuse_page
        self.episode_ms = NO_TIME_LIMIT_MS if episode_seconds is None else episode_seconds * 1000
        self.timeout = timeout
        self.page_config = PageConfig(scale=screenshot_scale)
        self.task: GUITask | None = None
        self.page_seed: int | None = None
        self.view: PageView | None = None
        self._host: BrowserHost | None = None
        self._page: TaskPage | None = None
        self._fresh_view = False
        self._requested_seed: int | None = None
        self._blocked_at_reset = 0
        self._crashed = False
        by_element = (self.click, self.type_text, self.select_option)
        on_pixels = (self.click_at, self.type_keys, self.press_key, self.scroll, self.wait)
        shown = on_pixels if observation == "screenshot" else by_element + on_pixels
        self._tool_list = tuple(Tool.from_function(f) for f in shown)

    # -- AgentEnv hooks ------------------------------------------------------------------
    def task_ids(self) -> Sequence[str]:
        return list(self.tasks)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        """Starts an episode; `options` may hold `task_id` and `page_seed` (an int in the
        split's seed range, for replaying an exact episode)."""
        requested = (options or {}).get("page_seed")
        if requested is not None:
            low, high = self.task_set.seeds
            if not isinstance(requested, int) or not low <= requested < high:
                raise ValueError(f"page_seed must be an int in [{low}, {high}) for {self.split}")
        self._requested_seed = requested
        return super().reset(seed=seed, options=options)

    def _load_task(self, task_id: str) -> None:
        self.task = self.tasks[task_id]
        low, high = self.task_set.seeds
        drawn = int(self.np_random.integers(low, high))
        self.page_seed = self._requested_seed if self._requested_seed is not None else drawn
        self._crashed = False
        try:
            self.view = self._run(self._start_episode())
        except BrowserCrashed:
            log.warning("the browser failed while starting %s; retrying once", task_id)
            self._discard_page()
            self.view = self._run(self._start_episode())
        self._fresh_view = True

    def _first_messages(self) -> list[Message]:
        prompt = SCREENSHOT_PROMPT if self.observation == "screenshot" else SYSTEM_PROMPT
        return [{"role": "system", "content": prompt}, self._page_message()]

    def _tools(self) -> Sequence[Tool]:
        return self._tool_list

    def reference_agent(self) -> ScriptedAgent | None:
        """MiniWoB++'s scripted solver of the task, where one is written; for a
        screenshot-only agent, the solver acting on pixels (`PixelGUIAgent`)."""
        if self.task is None or self.task.name not in SOLVERS:
            return None
        if self.observation == "screenshot":
            return PixelGUIAgent(self, self.task.name)
        return ScriptedGUIAgent(self.task.name)

    def element_point(self, element: int) -> tuple[float, float]:
        """Where element `element`'s centre is on the screenshot, in its pixels (what a
        reference agent acting on pixels clicks); `ToolCallError` for no such element."""
        target = self._run(self._locate(element))
        scale = self.page_config.scale
        return float(target["x"]) * scale, float(target["y"]) * scale

    def _info(self) -> dict[str, Any]:
        page = self._page
        view = self.view
        info: dict[str, Any] = {
            "split": self.split,
            "page_seed": self.page_seed,
            "blocked_requests": (page.blocked - self._blocked_at_reset) if page else 0,
        }
        if view is not None and view.done:
            info |= {"raw_reward": view.reward, "reason": view.reason}
        if self._crashed:
            info["browser_crashed"] = True
        return info

    def _after_action(self) -> Reply:
        """The page again after every action, or, when the page ended the episode on its
        own (its time limit), how it ended, with the page's reward."""
        with self._ending_on_crash():
            message = self._page_message()
        assert self.view is not None
        if self.view.done:
            ended: Message = {"role": "user", "content": _ended(self.view)}
            return Reply((ended,), self.view.reward, terminated=True)
        return Reply((message,))

    def close(self) -> None:
        """Closes this env's browser context and gives back the shared browser; idempotent."""
        self._discard_page()
        host, self._host = self._host, None
        if host is not None:
            release_host(host)

    # -- tools ---------------------------------------------------------------------------
    def click(self, element: int) -> ToolResult:
        """Clicks the centre of an element with the mouse.

        Args:
            element: the element's id, the number in [brackets] in the page view.
        """
        return self._run_step(self._click(element))

    def type_text(self, element: int, text: str, clear: bool = True) -> ToolResult:
        """Clicks a text field and types text into it with the keyboard.

        Args:
            element: id of an input, textarea or editable element.
            text: the text to type.
            clear: replace what the field holds (true) or add to it (false).
        """
        return self._run_step(self._type(element, text, clear))

    def press_key(self, key: str) -> ToolResult:
        """Presses a key or a combination on the keyboard.

        Args:
            key: a key name such as "Enter", "Tab", "Backspace", "ArrowDown", "a", or a
                combination such as "Control+a" or "Shift+Tab".
        """
        return self._run_step(self._press(key))

    def select_option(self, element: int, option: str) -> ToolResult:
        """Chooses an option of a drop-down list (<select>).

        Args:
            element: id of the <select> element.
            option: the option's text as shown in the page view.
        """
        return self._run_step(self._select(element, option))

    def scroll(
        self, direction: Direction, amount: int = 100, element: int | None = None
    ) -> ToolResult:
        """Scrolls the page, or the scrollable box that holds an element.

        Args:
            direction: "up", "down", "left" or "right".
            amount: how far, in pixels.
            element: id of an element inside the box to scroll; omit to scroll the page.
        """
        return self._run_step(self._scroll(direction, amount, element))

    def click_at(self, x: float, y: float) -> ToolResult:
        """Clicks at a point of the screenshot, for agents that act on pixels.

        Args:
            x: pixels from the screenshot's left edge.
            y: pixels from the screenshot's top edge.
        """
        return self._run_step(self._click_at(x, y))

    def type_keys(self, text: str) -> ToolResult:
        """Types text with the keyboard into whatever has focus (click a field first).

        Args:
            text: the text to type.
        """
        if not text:
            raise ToolCallError("text must not be empty")
        return self._run_step(self._type_keys(text))

    def wait(self, seconds: float) -> ToolResult:
        """Waits, for pages that change on their own (delayed buttons, suggestions).

        Args:
            seconds: how long to wait, at most 5.
        """
        if not 0 <= seconds <= MAX_WAIT_SECONDS:
            raise ToolCallError(f"seconds must be between 0 and {MAX_WAIT_SECONDS:g}")
        return self._run_step(self._wait(seconds))

    # -- browser side (coroutines run on the browser thread) ---------------------------
    async def _start_episode(self) -> PageView:
        assert self.task is not None and self.page_seed is not None
        page = self._page
        if page is None or not page.alive:
            if page is not None:
                await page.close()
            page = self._page = TaskPage(self._host_or_acquire(), self.page_config)
            await self._guard(page.open())
        self._blocked_at_reset = page.blocked
        if not (self.reuse_page and page.loaded == self.task.page and not self.task.stateful):
            await self._guard(page.load(self.task.page))
        mode = "train" if self.split == "train" else "test"
        await self._guard(page.park_mouse())
        started = await self._guard(
            page.begin(self.page_seed, mode, self.episode_ms, quiet=self.screenshot)
        )
        if started["problem"]:
            raise BrowserCrashed(f"{self.task.name}: {started['problem']}")
        return view_from_js(started["view"])

    async def _after(self, summary: str) -> ToolResult:
        page = self._live_page()
        self.view = view_from_js(await self._guard(page.observe()))
        self._fresh_view = True
        if self.view.done:
            return ToolResult(f"{summary}. {_ended(self.view)}", self.view.reward, terminated=True)
        return ToolResult(summary)

    async def _locate(self, element: int) -> dict[str, Any]:
        found = await self._guard(self._live_page().call("locate", element))
        if "error" in found:
            raise ToolCallError(found["error"])
        return dict(found)

    async def _click(self, element: int) -> ToolResult:
        target = await self._locate(element)
        await self._guard(self._live_page().page.mouse.click(target["x"], target["y"]))
        return await self._after(f"clicked [{element}] {target['tag']}")

    async def _type(self, element: int, text: str, clear: bool) -> ToolResult:
        target = await self._locate(element)
        if not target["editable"]:
            raise ToolCallError(f"element [{element}] is a <{target['tag']}>, not a text field")
        page = self._live_page().page
        await self._guard(page.mouse.click(target["x"], target["y"]))
        if clear:
            await self._guard(page.keyboard.press("ControlOrMeta+a"))
            await self._guard(page.keyboard.press("Delete"))
        await self._guard(page.keyboard.type(text))
        return await self._after(f"typed {len(text)} characters into [{element}]")

    async def _press(self, key: str) -> ToolResult:
        if not key.strip():
            raise ToolCallError("key must name a key, such as Enter or Tab")
        await self._guard(self._live_page().page.keyboard.press(key), agent_error=True)
        return await self._after(f"pressed {key}")

    async def _select(self, element: int, option: str) -> ToolResult:
        outcome = await self._guard(self._live_page().call("select", element, option))
        if "error" in outcome:
            raise ToolCallError(outcome["error"])
        return await self._after(f"selected {outcome['chosen']!r} in [{element}]")

    async def _scroll(self, direction: str, amount: int, element: int | None) -> ToolResult:
        if amount <= 0:
            raise ToolCallError("amount must be a positive number of pixels")
        dx, dy = (amount * unit for unit in _SCROLL[direction])
        outcome = await self._guard(self._live_page().call("scroll", element, dx, dy))
        if "error" in outcome:
            raise ToolCallError(outcome["error"])
        moved = "scrolled" if outcome["moved"] else "could not scroll further"
        return await self._after(f"{moved} {direction}")

    async def _click_at(self, x: float, y: float) -> ToolResult:
        scale = self.page_config.scale
        width, height = TASK_AREA["width"] * scale, TASK_AREA["height"] * scale
        if not (0 <= x < width and 0 <= y < height):
            raise ToolCallError(
                f"({x:g}, {y:g}) is outside the screenshot, which is {width:g} x {height:g}"
            )
        await self._guard(self._live_page().page.mouse.click(x / scale, y / scale))
        return await self._after(f"clicked at ({x:g}, {y:g})")

    async def _type_keys(self, text: str) -> ToolResult:
        await self._guard(self._live_page().page.keyboard.type(text))
        return await self._after(f"typed {len(text)} characters")

    async def _wait(self, seconds: float) -> ToolResult:
        await asyncio.sleep(seconds)
        return await self._after(f"waited {seconds:g} s")

    async def _guard(self, awaitable: Coroutine[Any, Any, T], agent_error: bool = False) -> T:
        """Awaits a page operation; a dead page is `BrowserCrashed`, and with `agent_error`
        any other Playwright error is the agent's (e.g. an unknown key name)."""
        try:
            return await awaitable
        except PlaywrightError as error:
            page = self._page
            if page is None or not page.alive or not agent_error:
                raise BrowserCrashed(str(error).splitlines()[0]) from error
            raise ToolCallError(str(error).splitlines()[0]) from None

    # -- helpers -------------------------------------------------------------------------
    def _live_page(self) -> TaskPage:
        page = self._page
        if page is None or not page.alive:
            raise BrowserCrashed("the task page is gone")
        return page

    def _host_or_acquire(self) -> BrowserHost:
        if self._host is None:
            self._host = acquire_host()
        return self._host

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._host_or_acquire().run(coro, self.timeout)

    def _run_step(self, coro: Coroutine[Any, Any, T]) -> T:
        """`_run` for a tool's work: a browser that fails ends the episode."""
        with self._ending_on_crash():
            return self._run(coro)

    @contextlib.contextmanager
    def _ending_on_crash(self) -> Iterator[None]:
        """Within a step, a failed browser ends the episode (`EpisodeAborted`: truncated,
        with an error observation); its page is dropped, and the next reset starts anew."""
        try:
            yield
        except BrowserCrashed as error:
            self._crashed = True
            self._discard_page()
            raise EpisodeAborted(f"the browser failed ({error})") from error

    def _discard_page(self) -> None:
        page, self._page = self._page, None
        if page is not None and self._host is not None and self._host.running:
            try:
                self._host.run(page.close(), self.timeout)
            except BrowserCrashed:
                log.warning("a browser context did not close in time")

    def _page_message(self) -> Message:
        """The page view; the one the last action left, if it left one (a fresh view is
        used once: the next step observes the page again)."""
        fresh, self._fresh_view = self._fresh_view, False
        if not fresh:
            page = self._live_page()
            self.view = view_from_js(self._run(self._guard(page.call("observe", 0))))
        assert self.view is not None
        shot = self._run(self._guard(self._live_page().screenshot())) if self.screenshot else None
        return page_message(self.view, shot, elements=self.observation != "screenshot")


def _ended(view: PageView) -> str:
    reason = f" ({view.reason})" if view.reason else ""
    return f"The task ended with reward {view.reward:g}{reason}."
