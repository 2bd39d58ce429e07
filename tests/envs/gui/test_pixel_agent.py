"""Gold tests of the screenshot-only GUI env's reference agent (`PixelGUIAgent`): the scripted
solvers, acting on pixels (a click at an element's centre, typing after a click), earn the
page's full reward with only the tools a screenshot agent is shown."""

import pytest

from envs.core import run_episode
from envs.gui.env import GUIEnv
from envs.gui.pixel_agent import NoPixelForm, PixelGUIAgent
from envs.gui.solvers import SOLVERS
from envs.gui.tasks import split_of

pytestmark = pytest.mark.browser

NO_PIXEL_FORM = {"choose-list": "select_option", "sign-agreement": "scroll"}
"""Solved tasks whose solver needs an action with no pixel form here."""
ON_PIXELS = sorted(set(SOLVERS) - set(NO_PIXEL_FORM))
SAMPLE = ["click-test", "click-checkboxes", "click-collapsible", "enter-text", "login-user"]
"""The default run's share: clicks, a section that opens, typing into fields."""
SCREENSHOT_TOOLS = {"click_at", "type_keys", "press_key", "scroll", "wait"}


@pytest.fixture(scope="module")
def envs():
    made = {s: GUIEnv(split=s, max_turns=8, observation="screenshot") for s in ("train", "test")}
    yield made
    for env in made.values():
        env.close()


class Recording:
    """The pixel agent, keeping the tool calls it makes."""

    def __init__(self, env: GUIEnv, name: str):
        self.agent, self.tools = PixelGUIAgent(env, name), set()

    def act(self, observation, info):
        action = self.agent.act(observation, info)
        self.tools |= {call["function"]["name"] for call in action["tool_calls"]}
        return action


def play(env: GUIEnv, name: str, seed: int = 0):
    agent = Recording(env, name)
    return run_episode(env, agent, task_id=f"miniwob/{name}", seed=seed), agent.tools


@pytest.mark.parametrize("name", SAMPLE)
def test_a_solver_on_pixels_earns_full_reward_with_screenshot_tools_only(envs, name):
    result, tools = play(envs[split_of(name)], name)
    assert result.total_reward == 1.0
    assert tools <= SCREENSHOT_TOOLS and "click_at" in tools


@pytest.mark.slow
@pytest.mark.parametrize("name", ON_PIXELS)
def test_every_solver_with_a_pixel_form_earns_full_reward_on_pixels(envs, name):
    assert play(envs[split_of(name)], name)[0].total_reward == 1.0


@pytest.mark.parametrize("name", sorted(NO_PIXEL_FORM))
def test_a_solver_needing_an_action_without_pixel_form_says_which(envs, name):
    env = envs[split_of(name)]
    observation, info = env.reset(seed=0, options={"task_id": f"miniwob/{name}"})
    agent = env.reference_agent()  # the screenshot env's own reference agent
    assert isinstance(agent, PixelGUIAgent)
    with pytest.raises(NoPixelForm, match=NO_PIXEL_FORM[name]):
        agent.act(observation, info)
