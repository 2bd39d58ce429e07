from envs.gui.render import Element, PageView, page_message, parse_rendering, render_page


def test_rendering_reads_back_to_the_same_elements():
    elements = (
        Element(1, 0, "div", "", {"id": "area"}),
        Element(2, 1, "button", 'Say "hi"', {"class": "a b", "focused": True}),
        Element(3, 1, "input", "", {"type": "text", "value": "x y", "checked": False}),
    )
    view = PageView("Click it.", elements, done=False, reward=0.0, reason=None)
    text = render_page(view)
    assert text.splitlines()[0] == "Task: Click it."
    assert '  [2] button "Say \\"hi\\"" class="a b" focused' in text
    utterance, parsed = parse_rendering(text)
    assert utterance == "Click it."
    assert [(e.id, e.depth, e.tag, e.text) for e in parsed] == [
        (1, 0, "div", ""),
        (2, 1, "button", 'Say "hi"'),
        (3, 1, "input", ""),
    ]
    assert parsed[2].attrs == {"type": "text", "value": "x y", "checked": "false"}


def test_screenshot_becomes_an_openai_image_part():
    view = PageView("Do it.", (), done=False, reward=0.0, reason=None)
    assert page_message(view) == {"role": "user", "content": "Task: Do it.\nPage:"}
    message = page_message(view, b"\x89PNG")
    assert message["content"][0] == {"type": "text", "text": "Task: Do it.\nPage:"}
    assert message["content"][1]["image_url"]["url"] == "data:image/png;base64,iVBORw=="


def test_screenshot_only_view_keeps_the_instruction_and_drops_the_elements():
    view = PageView("Do it.", (Element(1, 0, "button", "Go", {}),), False, 0.0, None)
    message = page_message(view, b"\x89PNG", elements=False)
    assert message["content"][0] == {"type": "text", "text": "Task: Do it."}
    assert message["content"][1]["type"] == "image_url"
