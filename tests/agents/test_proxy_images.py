"""Images through the proxy with the official `openai` client: a vision-language policy
(`tiny-vl`) sees them and the store keeps them byte-identical; bad images are clear 4xx."""

from __future__ import annotations

import contextlib

import openai
import pytest

from agents import vision
from agents.engines.base import SamplingParams
from agents.engines.embedded import EmbeddedEngine
from agents.rollout import run_episode
from agents.seats import DirectSeat, ProxySeat
from agents.serving.proxy import ProxyConfig
from agents.store import Store
from agents.trajectory import SessionStatus
from tests.agents.serving import running, served_client
from tests.agents.test_vision import jpeg, looking, png
from tests.trainers.faulty_envs import BAD_IMAGES, FaultyArith

LIMITS = {"max_image_bytes": 64 << 10, "max_images": 3}


@pytest.fixture(scope="module")
def vl_engine():
    engine = EmbeddedEngine("tiny-vl", threads=2)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def served(vl_engine, tmp_path_factory):
    config = ProxyConfig(**LIMITS)
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


@pytest.fixture(scope="module")
def seat(vl_engine, tmp_path_factory):
    """A `ProxySeat` on a proxy over the VL engine with `LIMITS` (as a run's rollouts reach
    the policy), and the proxy's store."""
    path = tmp_path_factory.mktemp("episodes") / "store.sqlite"
    with Store(path) as store, running(vl_engine, store, ProxyConfig(**LIMITS)) as (url, proxy):
        with contextlib.closing(ProxySeat(url, admin_key=proxy.admin_key)) as seat:
            yield seat, store


def play_bad_image(seat, store, image):
    """An episode whose first observation after a reply shows the bad `image`: the session
    it left."""
    env = FaultyArith(fault="image", image=image, max_turns=3)
    summary = run_episode(
        env, seat, env_id="bad", seed=0, sampling=SamplingParams(max_tokens=4, seed=0)
    )
    return store.session(summary.session_id)


@pytest.mark.parametrize(
    ("image", "says"),
    [
        ("gif", "image/gif"),
        ("remote", "an image by URL is not supported"),
        ("large", "over 65536 bytes"),
        ("many", "8 images in one request; at most 3"),
    ],
)
def test_a_bad_image_from_the_env_fails_its_episode_with_the_reason(seat, image, says):
    """The proxy's 400 ends the episode failed, saying what is wrong; the turn before is
    kept, with the observation that held the image as its next state, as it came (a
    PNG by its sha256, a URL no image can be read from inline)."""
    session = play_bad_image(*seat, image)
    assert session.status == SessionStatus.FAILED
    assert says in session.metadata["end_reason"]
    (turn,) = session.turns
    assert vision.message_images(turn.next_state) == BAD_IMAGES[image]


def test_a_bad_image_played_in_process_fails_its_episode_too(vl_engine, tmp_path):
    """`DirectSeat` (the leaderboard's): the engine refuses the image by its own limits."""
    with Store(tmp_path / "store.sqlite") as store:
        session = play_bad_image(DirectSeat(vl_engine, store), store, "gif")
    assert session.status == SessionStatus.FAILED
    assert "image/gif" in session.metadata["end_reason"]
    assert len(session.turns) == 1
