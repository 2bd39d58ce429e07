"""clawgym/GUI-v0 on real Chromium: observations, tools, errors, seeds and the browser's
life cycle (sharing, crash, close)."""

import base64
import struct

import pytest
from playwright.async_api import Error as PlaywrightError

from envs.core import ERROR_PREFIX, IdleAgent, run_episode
from envs.gui.env import GUIEnv
from envs.gui.render import parse_rendering
from tests.envs.gui.conftest import call, calls

pytestmark = pytest.mark.browser


def page_of(observation):
    return parse_rendering(observation[-1]["content"])


def test_reset_shows_the_instruction_and_the_visible_page_with_ids(gui_env):
    observation, info = gui_env.reset(seed=0, options={"task_id": "miniwob/enter-text"})
    assert [m["role"] for m in observation] == ["system", "user"]
    utterance, elements = page_of(observation)
    assert utterance.startswith("Enter ") and "Submit" in utterance
    assert [e.tag for e in elements if e.attrs.get("id") in ("tt", "subbtn")] == ["input", "button"]
    assert {t["function"]["name"] for t in info["tools"]} == {
        "click",
        "type_text",
        "type_keys",
        "press_key",
        "select_option",
        "scroll",
        "click_at",
        "wait",
    }
    assert info["split"] == "train" and info["blocked_requests"] == 0
    # MiniWoB's own chrome (sync screen, reward display, the query itself) is not rendered.
    assert (
        "Last reward" not in observation[1]["content"] and "START" not in observation[1]["content"]
    )


def test_same_seed_same_episode_other_seed_other_episode(gui_env):
    first, info = gui_env.reset(seed=11)
    again, info_again = gui_env.reset(seed=11)
    assert first == again and info["page_seed"] == info_again["page_seed"]
    other = gui_env.reset(
        seed=11, options={"task_id": info["task_id"], "page_seed": info["page_seed"] + 1}
    )[0]
    assert other != first


def test_page_seed_option_replays_an_episode_and_must_stay_in_the_split(gui_env):
    options = {"task_id": "miniwob/enter-text", "page_seed": 1234}
    observation, info = gui_env.reset(options=options)
    assert info["page_seed"] == 1234
    assert gui_env.reset(seed=99, options=options)[0] == observation
    with pytest.raises(ValueError, match="page_seed"):
        gui_env.reset(options={"page_seed": 1_500_000_000})  # a held-out seed


def test_typing_and_clicking_finish_the_task_with_the_pages_reward(gui_env):
    observation, _ = gui_env.reset(seed=3, options={"task_id": "miniwob/enter-text"})
    utterance, elements = page_of(observation)
    word = utterance.split('"')[1]
    field = next(e for e in elements if e.attrs.get("id") == "tt")
    observation, reward, terminated, truncated, _ = gui_env.step(
        call("type_text", element=field.id, text=word)
    )
    assert (reward, terminated) == (0.0, False)
    assert next(e for e in page_of(observation)[1] if e.id == field.id).attrs["value"] == word
    button = next(e for e in elements if e.tag == "button")
    observation, reward, terminated, truncated, info = gui_env.step(
        call("click", element=button.id)
    )
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["raw_reward"] == 1.0 and "reward 1" in observation[0]["content"]


def test_a_wrong_answer_ends_with_the_pages_negative_reward(gui_env):
    observation, _ = gui_env.reset(seed=4, options={"task_id": "miniwob/choose-list"})
    _, elements = page_of(observation)
    select = next(e for e in elements if e.tag == "select")
    wanted = page_of(observation)[0].split("Select ")[1].split(" from")[0]
    wrong = next(o for o in select.attrs["options"].split(" | ") if o != wanted)
    button = next(e for e in elements if e.tag == "button")
    action = calls(
        ("select_option", {"element": select.id, "option": wrong}),
        ("click", {"element": button.id}),
    )
    observation, reward, terminated, _, _ = gui_env.step(action)
    assert (reward, terminated) == (-1.0, True)


@pytest.mark.parametrize(
    ("action", "fragment"),
    [
        (call("click", element=999), "no element [999]"),
        (call("type_text", element=1, text="x"), "not a text field"),
        (call("select_option", element=1, option="x"), "not a <select>"),
        (call("press_key", key="NoSuchKey"), "Unknown key"),
        (call("click_at", x=1000, y=5), "outside the screenshot"),
        (call("scroll", direction="sideways"), "should be one of"),
        (call("wait", seconds=60), "between 0 and 5"),
        (calls(("click", {"element": "three"})), "should be a JSON integer"),
        (
            {
                "role": "assistant",
                "tool_calls": [{"id": "c0", "function": {"name": "click", "arguments": "{"}}],
            },
            "not valid JSON",
        ),
    ],
)
def test_bad_actions_are_error_observations_not_crashes(gui_env, action, fragment):
    gui_env.reset(seed=5, options={"task_id": "miniwob/click-test"})
    observation, reward, terminated, truncated, info = gui_env.step(action)
    assert observation[0]["role"] == "tool" and observation[0]["content"].startswith(ERROR_PREFIX)
    assert fragment in observation[0]["content"]
    assert (reward, terminated, truncated, info["turn"]) == (0.0, False, False, 1)
    assert observation[-1]["content"].startswith("Task: Click the button.")  # the page, again


def test_select_reports_the_options_when_the_option_is_missing(gui_env):
    observation, _ = gui_env.reset(seed=6, options={"task_id": "miniwob/choose-list"})
    select = next(e for e in page_of(observation)[1] if e.tag == "select")
    observation = gui_env.step(call("select_option", element=select.id, option="Nowhere"))[0]
    assert (
        "has no option" in observation[0]["content"]
        and select.attrs["options"].split(" | ")[0] in observation[0]["content"]
    )


def test_scroll_moves_a_scrollable_box(gui_env):
    observation, _ = gui_env.reset(seed=7, options={"task_id": "miniwob/scroll-text"})
    area = next(e for e in page_of(observation)[1] if e.tag == "textarea")
    observation = gui_env.step(call("scroll", direction="down", amount=200, element=area.id))[0]
    assert observation[0]["content"] == "scrolled down"
    observation = gui_env.step(call("scroll", direction="up", amount=5000, element=area.id))[0]
    assert observation[0]["content"] == "scrolled up"
    observation = gui_env.step(call("scroll", direction="up", amount=5000, element=area.id))[0]
    assert observation[0]["content"] == "could not scroll further up"


def button_centre(env: GUIEnv) -> tuple[float, float]:
    """Where click-test's button is, read from the page itself (test-only access)."""
    button = next(e for e in env.view.elements if e.tag == "button")
    found = env._run(env._page.call("locate", button.id))
    return found["x"], found["y"]


def test_click_at_coordinates_hits_the_element_there(gui_env):
    gui_env.reset(seed=8, options={"task_id": "miniwob/click-test"})
    x, y = button_centre(gui_env)
    assert gui_env.step(call("click_at", x=x, y=y + 40))[1:3] == (0.0, False)  # below it: nothing
    _, reward, terminated, _, _ = gui_env.step(call("click_at", x=x, y=y))
    assert (reward, terminated) == (1.0, True)


def test_idle_agent_earns_nothing_and_runs_out_of_turns():
    env = GUIEnv(tasks=["click-test", "enter-text"], max_turns=3)
    try:
        for seed in range(2):
            result = run_episode(env, IdleAgent(), seed=seed)
            assert (result.total_reward, result.truncated, result.terminated, result.turns) == (
                0.0,
                True,
                False,
                3,
            )
    finally:
        env.close()


def test_screenshot_is_a_png_of_the_task_area_at_the_chosen_scale():
    env = GUIEnv(tasks=["click-test"], observation="both", screenshot_scale=2.0)
    try:
        observation, _ = env.reset(seed=0)
        text, image = observation[1]["content"]
        assert text["type"] == "text" and text["text"].startswith("Task: Click the button.")
        png = base64.b64decode(image["image_url"]["url"].removeprefix("data:image/png;base64,"))
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        assert struct.unpack(">II", png[16:24]) == (320, 420)
        # click_at takes screenshot pixels, twice the page's CSS pixels at scale 2.
        x, y = button_centre(env)
        assert env.step(call("click_at", x=2 * x, y=2 * y))[1] == 1.0
    finally:
        env.close()


def test_screenshot_only_agent_sees_the_instruction_and_a_png_and_acts_on_pixels():
    env = GUIEnv(tasks=["click-test", "enter-text"], observation="screenshot")
    try:
        observation, info = env.reset(seed=0, options={"task_id": "miniwob/click-test"})
        assert {t["function"]["name"] for t in info["tools"]} == {
            "click_at",
            "type_keys",
            "press_key",
            "scroll",
            "wait",
        }
        assert "click at x, y" in observation[0]["content"]
        text, image = observation[1]["content"]
        assert text == {"type": "text", "text": "Task: Click the button."}  # no element list
        assert image["image_url"]["url"].startswith("data:image/png;base64,iVBORw0KGgo")
        x, y = button_centre(env)
        assert env.step(call("click_at", x=x, y=y))[1] == 1.0
        # typing into the focused field, by pixels only, solves enter-text
        env.reset(seed=0, options={"task_id": "miniwob/enter-text"})
        utterance = env.view.utterance
        word = utterance[utterance.index('"') + 1 : utterance.rindex('"')]
        field = next(e for e in env.view.elements if e.tag == "input")
        button = next(e for e in env.view.elements if e.tag == "button")
        spot, target = (env._run(env._page.call("locate", e.id)) for e in (field, button))
        env.step(call("click_at", x=spot["x"], y=spot["y"]))
        env.step(call("type_keys", text=word))
        assert env.step(call("click_at", x=target["x"], y=target["y"]))[1] > 0
    finally:
        env.close()


def test_unknown_observation_is_a_clear_error():
    with pytest.raises(ValueError, match="observation must be one of"):
        GUIEnv(observation="pixels")


def test_the_pages_own_time_limit_ends_the_episode_when_asked_for():
    env = GUIEnv(tasks=["click-test"], episode_seconds=0.3)
    try:
        env.reset(seed=0)
        observation, reward, terminated, truncated, info = env.step(call("wait", seconds=0.6))
        assert (reward, terminated, truncated) == (-1.0, True, False)
        assert info["reason"] == "timed out" and "reward -1" in observation[0]["content"]
    finally:
        env.close()


def test_a_restarted_page_that_fetches_nothing_starts_in_one_call_others_wait_for_files():
    # The grace period for files fetched while a problem is laid out is paid on a page
    # just loaded and on pages whose episodes fetch files (email-inbox's icons are CSS
    # `content` images that give elements their size), not on every reset.
    env = GUIEnv(tasks=["click-test", "email-inbox"])
    try:
        for task, fetches in (("click-test", False), ("email-inbox", True)):
            # A page just loaded waits, and learns whether its episodes fetch files.
            first = env.reset(seed=3, options={"task_id": f"miniwob/{task}"})[0]
            assert env._page.fetches is fetches
            again = env.reset(seed=3, options={"task_id": f"miniwob/{task}"})[0]
            assert env._page.fetches is fetches and again == first
    finally:
        env.close()


def test_a_script_error_in_the_page_is_a_playwright_error(gui_env):
    gui_env.reset(seed=0, options={"task_id": "miniwob/click-test"})
    with pytest.raises(PlaywrightError, match="no_such_function"):
        gui_env._run(gui_env._page.call("no_such_function"))
