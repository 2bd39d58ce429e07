"""Images in stored turns: kept once each beside the SQLite file, read back byte-identical."""

import json

import datasets
import pytest

from agents import vision
from agents.store import Store
from agents.store_images import ImageFiles
from agents.trajectory import Session
from tests.agents.test_trajectory import make_turn
from tests.agents.test_vision import jpeg, png


def seeing(*images, text="the page"):
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": vision.data_url(i)}} for i in images]
    return {"role": "user", "content": parts}


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "store.sqlite") as opened:
        opened.add_session(Session("s", "clawgym/GUI-v0"))
        yield opened


def test_images_round_trip_byte_identical_and_are_kept_once(store):
    first, second = png((96, 64)), jpeg()
    turn0 = make_turn(prompt_messages=({"role": "system", "content": "s"}, seeing(first)))
    turn1 = make_turn(index=1, prompt_messages=(*turn0.prompt_messages, seeing(first, second)))
    store.add_turn(turn0)
    store.add_turn(turn1)
    store.set_next_state("s", 0, [seeing(second, text="next")])
    turns = store.session("s").turns
    assert turns[0].prompt_messages == turn0.prompt_messages
    assert turns[1].prompt_messages == turn1.prompt_messages
    assert turns[0].next_state == (seeing(second, text="next"),)
    url = turns[1].prompt_messages[-1]["content"][2]["image_url"]["url"]
    assert vision.decode_data_url(url) == second
    # two images mentioned five times: two files, named by their sha256
    names = sorted(p.name for p in store.images.folder.iterdir())
    assert names == sorted([vision.digest(first) + ".png", vision.digest(second) + ".jpg"])
    # the SQLite rows hold references, not the bytes
    raw = store._db().execute("SELECT prompt_messages, next_state FROM turns").fetchall()
    text = "".join(r[0] + (r[1] or "") for r in raw)
    assert "base64" not in text and text.count("sha256:") == 5


def test_parquet_export_carries_the_images_inline(store, tmp_path):
    image = png((64, 32))
    store.add_turn(make_turn(prompt_messages=(seeing(image),)))
    path = store.export_parquet(tmp_path / "turns.parquet")
    row = datasets.Dataset.from_parquet(str(path)).to_list()[0]
    part = json.loads(row["prompt_messages"])[0]["content"][1]
    assert vision.decode_data_url(part["image_url"]["url"]) == image


def test_text_turns_are_stored_as_before(store):
    store.add_turn(make_turn())
    assert not store.images.folder.exists()


def test_a_reference_outside_the_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not an image reference"):
        ImageFiles(tmp_path).get("sha256:../../etc/passwd")
