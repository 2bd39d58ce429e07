"""Images through the proxy with the official `openai` client: a vision-language policy
(`tiny-vl`) sees them and the store keeps them byte-identical; bad images are clear 4xx."""

from __future__ import annotations

import openai
import pytest

from agents import vision
from agents.engines.embedded import EmbeddedEngine
from agents.serving.proxy import ProxyConfig
from tests.agents.serving import served_client
from tests.agents.test_vision import jpeg, looking, png


@pytest.fixture(scope="module")
def vl_engine():
    engine = EmbeddedEngine("tiny-vl", threads=2)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def served(vl_engine, tmp_path_factory):
    config = ProxyConfig(max_image_bytes=64 << 10, max_images=3)
    with served_client(vl_engine, tmp_path_factory.mktemp("images"), config) as client_and_store:
        yield client_and_store


def test_a_vl_policy_answers_a_screenshot_and_the_store_keeps_it_exactly(served, vl_engine):
    client, store = served
    shots = (png((96, 64)), jpeg())
    messages = looking(*shots)
    reply = client.chat.completions.create(
        model="policy", messages=messages, max_tokens=4, extra_body={"session_id": "see"}
    )
    assert reply.choices[0].message.role == "assistant"
    (turn,) = store.session("see").turns
    assert turn.prompt_messages == tuple(messages)
    assert vision.images_of(turn.prompt_messages) == list(shots)
    pad = vl_engine.model.config.image_token_id
    assert turn.prompt_token_ids.count(pad) == 6 + 4  # 96x64: 6 merged patches; 64x64: 4
    assert sorted(p.name[-4:] for p in store.images.folder.iterdir()) == [".jpg", ".png"]


def test_streaming_with_an_image_gives_the_same_tokens(served):
    client, store = served
    messages = looking(png((64, 64), (1, 1, 1)))
    kwargs = {"model": "policy", "messages": messages, "max_tokens": 6, "seed": 3}
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(**kwargs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


BAD = {
    "a remote URL": (
        [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}],
        "not supported",
    ),
    "a GIF": ([{"type": "image_url", "image_url": {"url": "data:image/gif;base64,R0lG"}}], "gif"),
    "too large": (looking(png((400, 400), (1, 2, 3)) + b"\0" * (70 << 10))[0]["content"], "over"),
    "too many": (looking(png(), png(), png(), png())[0]["content"], "4 images"),
    "not a PNG": (
        [{"type": "image_url", "image_url": {"url": "data:image/png;base64,R0lGODlh"}}],
        "neither a PNG",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_images_are_a_400_and_commit_nothing(served, case):
    client, store = served
    content, says = BAD[case]
    turns = store.count_turns()
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": content}], max_tokens=2
        )
    assert says in raised.value.body["message"]
    assert store.count_turns() == turns


def test_a_text_model_refuses_images_with_a_400(tiny_engine, tmp_path):
    with served_client(tiny_engine, tmp_path) as (client, store):
        with pytest.raises(openai.BadRequestError, match="takes no images"):
            client.chat.completions.create(model="policy", messages=looking(png()), max_tokens=2)
        assert store.count_turns() == 0
