"""The tiny vision-language model and the image plumbing of `agents.vision`, on real
Qwen3-VL code with random weights."""

import base64
import io

import pytest
import torch
from PIL import Image

from agents import models, vision
from agents.engines import template


def png(size=(96, 64), color=(20, 120, 200)):
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


def jpeg(size=(64, 64)):
    buffer = io.BytesIO()
    Image.new("RGB", size, (250, 10, 10)).save(buffer, "JPEG")
    return buffer.getvalue()


def looking(*images):
    parts = [{"type": "text", "text": "click the button"}]
    parts += [{"type": "image_url", "image_url": {"url": vision.data_url(i)}} for i in images]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def tiny_vl():
    model, tokenizer = models.load("tiny-vl")
    return model, tokenizer, vision.Pixels(models.resolve("tiny-vl"))


def test_tiny_vl_is_a_small_qwen3_vl(tiny_vl):
    model, _, _ = tiny_vl
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert models.is_vision("tiny-vl") and not models.is_vision("tiny")
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 5e6


def test_tiny_vl_template_renders_an_image_part_as_one_placeholder(tiny_vl):
    _, tokenizer, _ = tiny_vl
    text = template.render(tokenizer, looking(png()), None, tokenize=False)
    assert "click the button" + models.IMAGE_PLACEHOLDER + "<|im_end|>" in text
    # a text model's template renders no image (the proxy refuses images for it)
    plain = template.render(models.load_tokenizer("tiny"), looking(png()), None, tokenize=False)
    assert "vision" not in plain and "click the button<|im_end|>" in plain


def test_placeholders_expand_to_the_merged_patches_the_model_needs(tiny_vl):
    model, tokenizer, pixels = tiny_vl
    messages = looking(png((96, 64)), png((200, 150), (0, 0, 0)))
    inputs = pixels(vision.images_of(messages))
    # 96x64 is 6x4 patches of 16 pixels, 2x2 merged: 6 tokens; 200x150 resizes to 192x160
    assert inputs.image_grid_thw.tolist() == [[1, 4, 6], [1, 10, 12]]
    assert pixels.token_counts(inputs) == [6, 30]
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids = vision.expand(template.encode(tokenizer, messages), pad, pixels.token_counts(inputs))
    assert ids.count(pad) == 36
    x = torch.tensor([ids])
    with torch.no_grad():  # the model checks the pads against the image features
        logits = model(input_ids=x, **vision.forward_inputs(model, x, torch.ones_like(x), inputs))
    assert logits.logits.shape == (1, len(ids), model.config.text_config.vocab_size)
    with pytest.raises(ValueError, match="2 images"):
        vision.expand([1, pad, 2], pad, [6, 30])


def test_pixels_are_cached_per_image(tiny_vl):
    _, _, pixels = tiny_vl
    image = png((64, 64), (1, 2, 3))
    first = pixels.one(image)
    assert pixels.one(image)[0] is first[0]


def test_data_urls_round_trip_png_and_jpeg():
    for image, kind in ((png(), "image/png"), (jpeg(), "image/jpeg")):
        url = vision.data_url(image)
        assert url.startswith(f"data:{kind};base64,")
        assert vision.decode_data_url(url) == image


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("https://example.com/cat.png", "'https' URL is not fetched"),
        ("data:image/gif;base64,R0lGODlh", "image/gif"),
        ("data:image/png,rawbytes", "must be base64"),
        ("data:image/png;base64,@@@", "malformed"),
        ("data:image/png;base64," + base64.b64encode(b"GIF89a....").decode(), "neither a PNG"),
        ("data:image/png;base64," + base64.b64encode(jpeg()).decode(), "says image/png"),
    ],
)
def test_bad_image_urls_say_what_is_wrong(url, error):
    with pytest.raises(vision.BadImage, match=error):
        vision.decode_data_url(url)


def test_size_and_count_limits():
    limits = vision.ImageLimits(max_bytes=100, max_images=1)
    with pytest.raises(vision.BadImage, match="over 100 bytes"):
        vision.decode_data_url(vision.data_url(png((300, 300), (1, 2, 3)) + b"x" * 200), limits)
    with pytest.raises(vision.BadImage, match="2 images in one request; at most 1"):
        vision.images_of(looking(png(), png()), vision.ImageLimits(max_images=1))


def test_markup_tokens_are_never_sampled_nor_scored(tiny_vl):
    model, tokenizer, _ = tiny_vl
    banned = vision.markup_ids(model.config)
    names = tokenizer.convert_ids_to_tokens(banned)
    assert names == ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
    logits = torch.zeros(2, 8)
    masked = vision.masked_logits(logits, torch.tensor([1, 5]))
    logprobs = torch.log_softmax(masked, -1)
    assert logprobs[0, 0] == pytest.approx(-1.791759) and logprobs[0, 1].exp() == 0
    # finite, so an entropy's 0 x log 0 is 0: the entropy of 6 equal choices
    assert float(-(logprobs.exp() * logprobs).sum(-1)[0]) == pytest.approx(1.791759)
    assert vision.masked_logits(logits, None) is logits
