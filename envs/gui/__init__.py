"""The GUI environment family: MiniWoB++'s task pages in Debian's Chromium, via Playwright.

`env.py` holds `clawgym/GUI-v0`, `tasks.py` its task set and splits, `browser.py` the
per-process browser, `page.py` one environment's isolated browser context, `render.py`
what the agent sees, `solvers.py` scripted reference solvers.
"""
