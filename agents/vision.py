"""Images in chat messages, and a vision-language model's inputs from them.

An image reaches the policy as an OpenAI `image_url` content part whose URL is a data URL of
a PNG or JPEG (`data:image/png;base64,...`), exactly as the `openai` client sends one. Only
data URLs are taken: the proxy fetches nothing from the network, and a turn must hold the
very bytes the policy saw.

A vision-language model's prompt is the chat template's rendering, each image part one
placeholder (Qwen-VL's `<|vision_start|><|image_pad|><|vision_end|>`), with the pad token
repeated once per merged patch of that image (`expand`), as Qwen-VL's own processor does:
the prompt ids stored with a turn are the expanded ones the model ran on. The pixels come
from the model's image processor (`AutoImageProcessor`, saved beside its weights), once per
image: `Pixels` caches them by the image's sha256, so the engine, the learner and the
judge that see one screenshot again never preprocess it twice. The engine and the learner
build the model's inputs with the same function (`forward_inputs`), M-RoPE positions
included, so an image's tokens sit at the same positions in both.

Qwen-VL's processor class is not used because transformers builds it only with a video
processor, which needs torchvision; the expansion here is the processor's own rule.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agents.config import MAX_IMAGE_BYTES, MAX_IMAGES

SIGNATURES = {"image/png": b"\x89PNG\r\n\x1a\n", "image/jpeg": b"\xff\xd8\xff"}
"""The image types taken, and the bytes each file starts with."""
IMAGE_PARTS = ("image_url", "image")
"""Content part types that carry an image (OpenAI's, and transformers' own)."""


class BadImage(ValueError):
    """An image part the server does not take: not a data URL, not PNG or JPEG, too large,
    or too many of them."""


@dataclass(frozen=True)
class ImageLimits:
    """What one request may carry (`model.max_image_bytes`, `model.max_images`:
    `agents.compose.image_limits`)."""

    max_bytes: int = MAX_IMAGE_BYTES
    """Largest decoded image."""
    max_images: int = MAX_IMAGES
    """Most images in one request's messages."""


def data_url(image: bytes) -> str:
    """The data URL of a PNG or JPEG."""
    return f"data:{image_type(image)};base64,{base64.b64encode(image).decode()}"


def image_type(image: bytes) -> str:
    """ "image/png" or "image/jpeg", from the file's first bytes; `BadImage` otherwise."""
    for kind, signature in SIGNATURES.items():
        if image.startswith(signature):
            return kind
    raise BadImage("the image is neither a PNG nor a JPEG (by its first bytes)")


def decode_data_url(url: str, limits: ImageLimits | None = ImageLimits()) -> bytes:
    """The image bytes of a PNG or JPEG data URL; `BadImage` says what is wrong. `limits`
    None: any size (an image already admitted: a stored turn's)."""
    if not url.startswith("data:"):
        where = url.split(":", 1)[0] if ":" in url[:10] else "this"
        raise BadImage(
            f"a {where!r} URL is not fetched: send the image inline as a data URL "
            "(data:image/png;base64,...)"
        )
    header, sep, payload = url[5:].partition(",")
    kind, _, encoding = header.partition(";")
    if not sep or encoding != "base64":
        raise BadImage("a data URL must be base64: data:image/png;base64,...")
    if kind not in SIGNATURES:
        raise BadImage(f"images of type {kind!r} are not taken; send image/png or image/jpeg")
    if limits is not None and len(payload) * 3 // 4 > limits.max_bytes + 3:
        raise BadImage(f"the image is over {limits.max_bytes} bytes")
    try:
        image = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise BadImage(f"the data URL's base64 is malformed: {error}") from None
    if limits is not None and len(image) > limits.max_bytes:
        raise BadImage(f"the image is {len(image)} bytes; at most {limits.max_bytes}")
    if image_type(image) != kind:
        raise BadImage(f"the data URL says {kind} but the bytes are not one")
    return image


def part_url(part: Mapping[str, Any]) -> str | None:
    """The URL of an image content part (`{"type": "image_url", "image_url": {"url": ...}}`
    or transformers' `{"type": "image", "url": ...}`); None for another part."""
    if part.get("type") not in IMAGE_PARTS:
        return None
    inner = part.get("image_url")
    url = inner.get("url") if isinstance(inner, Mapping) else part.get("url")
    return url if isinstance(url, str) else ""


def message_images(messages: Iterable[Mapping[str, Any]]) -> list[str]:
    """The URLs of every image part of `messages`, in the order the template renders them."""
    urls = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            urls += [
                u for p in content if isinstance(p, Mapping) and (u := part_url(p)) is not None
            ]
    return urls


def images_of(
    messages: Iterable[Mapping[str, Any]], limits: ImageLimits | None = ImageLimits()
) -> list[bytes]:
    """The decoded images of `messages`, in order; `BadImage` for a bad one or too many
    (`limits` None: any number and size, for images already admitted)."""
    urls = message_images(messages)
    if limits is not None and len(urls) > limits.max_images:
        raise BadImage(f"{len(urls)} images in one request; at most {limits.max_images}")
    return [decode_data_url(url, limits) for url in urls]


def digest(image: bytes) -> str:
    """The sha256 an image is stored and cached under."""
    return hashlib.sha256(image).hexdigest()


# -- the model's inputs ---------------------------------------------------------------------


@dataclass(frozen=True)
class PixelInputs:
    """The image processor's output for a prompt's images, in order."""

    pixel_values: torch.Tensor
    """(patches, channels x temporal x patch x patch), every image's patches in turn."""
    image_grid_thw: torch.Tensor
    """(images, 3): each image's grid of patches, before merging."""


class Pixels:
    """A model's image processor, its outputs cached per image (by sha256).

    Args:
        path: the model's directory (its `preprocessor_config.json`).
        capacity: most images whose outputs are kept.
    """

    def __init__(self, path: str | Path, capacity: int = 256):
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(path)
        self.merge = int(self.processor.merge_size)
        self.capacity = capacity
        self._cache: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def one(self, image: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values, grid_thw of shape (3,)) of one image."""
        key = digest(image)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        from PIL import Image

        picture = Image.open(io.BytesIO(image)).convert("RGB")
        out = self.processor(images=[picture], return_tensors="pt")
        entry = (out["pixel_values"], out["image_grid_thw"][0])
        with self._lock:
            self._cache[key] = entry
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return entry

    def __call__(self, images: Sequence[bytes]) -> PixelInputs | None:
        """The processor's output for `images`, in order; None for none."""
        if not images:
            return None
        pieces = [self.one(image) for image in images]
        return PixelInputs(torch.cat([p[0] for p in pieces]), torch.stack([p[1] for p in pieces]))

    def token_counts(self, pixels: PixelInputs | None) -> list[int]:
        """How many placeholder tokens each image takes: its merged patches."""
        if pixels is None:
            return []
        return [int(g.prod()) // self.merge**2 for g in pixels.image_grid_thw]

    def expanded(self, ids: Sequence[int], images: Sequence[bytes], pad_id: int) -> list[int]:
        """`ids` with each image's placeholder `pad_id` repeated for its tokens (`expand`):
        the ids the model is fed, in the engine and in demonstrations alike."""
        return expand(ids, pad_id, self.token_counts(self(images)))


def expand(ids: Sequence[int], pad_id: int, counts: Sequence[int]) -> list[int]:
    """`ids` with the i-th `pad_id` repeated `counts[i]` times (Qwen-VL's processor's rule);
    `ValueError` if the pads and the images disagree in number."""
    found = sum(1 for token in ids if token == pad_id)
    if found != len(counts):
        raise ValueError(
            f"the prompt has {found} image placeholders for {len(counts)} images: the chat "
            "template renders each image part as one placeholder"
        )
    out: list[int] = []
    images = iter(counts)
    for token in ids:
        out += [token] * next(images) if token == pad_id else [token]
    return out


def markup_ids(config: Any) -> list[int]:
    """A vision-language model's image and video token ids (placeholders, start, end).

    The policy never samples them: a placeholder in a completion would be an image token
    with no image in the learner's pass over prompt and completion (the model counts every
    placeholder in its input), where the engine's decoding fed it as a plain token. So the
    policy's next-token distribution is the model's with these tokens masked out, in the
    engine (`agents.engines.batching.Scheduler`, `agents.engines.vision_decode`) and in the
    learner alike (`masked_logits`)."""
    return [
        config.image_token_id,
        config.video_token_id,
        config.vision_start_token_id,
        config.vision_end_token_id,
    ]


def masked_logits(logits: torch.Tensor, banned: torch.Tensor | None) -> torch.Tensor:
    """`logits` with the `banned` token ids (last dimension) at the dtype's lowest finite
    value (`markup_ids`): probability 0 after softmax, and a finite log-prob, so that an
    entropy's 0 x log 0 is 0, not NaN."""
    if banned is None:
        return logits
    return logits.index_fill(-1, banned.to(logits.device), torch.finfo(logits.dtype).min)


def forward_inputs(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, pixels: PixelInputs | None
) -> dict[str, Any]:
    """The keyword inputs of a vision-language model's forward pass over a batch of
    right-padded rows `ids`: the pixels, and M-RoPE positions computed from the ids and the
    image grids (the same in the engine's prefill and the learner's pass)."""
    config = model.config
    types = (ids == config.image_token_id).int()
    merge = config.vision_config.spatial_merge_size
    needed = 0 if pixels is None else int(pixels.image_grid_thw.prod(-1).sum()) // merge**2
    if int(types.sum()) != needed:
        raise ValueError(
            f"the ids hold {int(types.sum())} image placeholders for images of {needed} "
            "tokens: score a prompt with the very images it was sampled with"
        )
    grid = None if pixels is None else pixels.image_grid_thw.to(ids.device)
    positions, _ = _base(model).get_rope_index(
        ids, mm_token_type_ids=types, image_grid_thw=grid, attention_mask=mask
    )
    inputs: dict[str, Any] = {"attention_mask": mask, "position_ids": positions}
    if pixels is not None:
        dtype = next(model.parameters()).dtype
        inputs["pixel_values"] = pixels.pixel_values.to(ids.device, dtype)
        inputs["image_grid_thw"] = grid
        inputs["mm_token_type_ids"] = types
    return inputs


def _base(model: Any) -> Any:
    """The model that owns `get_rope_index` (`model.model` of a conditional-generation
    model, through a peft wrapper if there is one)."""
    while not hasattr(model, "get_rope_index"):
        model = model.model if hasattr(model, "model") else model.base_model
    return model
