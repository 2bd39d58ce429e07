"""The images of a store's turns, each kept once, content-addressed, beside the SQLite file.

A turn whose messages carry images (a GUI env's screenshots, a client's photos) would hold
each as a base64 data URL in its JSON, again in every later turn of the session (a prompt
repeats the history) and in the turn before's next state: the SQLite file would swell by
the same megabytes many times over. Instead each image is written once, as a file named by
the sha256 of its bytes, in the folder `<store file>.images/`, and the messages in the
store carry `sha256:<hex>.<png|jpg>` where the data URL was. Reading a turn back puts the
data URL back, byte for byte what the policy saw (base64 has one encoding of given bytes,
and the proxy takes no other: `agents.vision.decode_data_url`). A URL that is no PNG or
JPEG data URL (a remote URL, a GIF an environment showed in a next state the policy was
then refused) stays in the messages as it came: the store keeps what it is given.

A file is written (to a temporary name, then renamed) before the row that names it is
committed, so a row never names a missing image; a crash may leave an unreferenced file,
never a half-written one.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agents import vision

REF = "sha256:"
_SUFFIX = {"image/png": ".png", "image/jpeg": ".jpg"}


class ImageFiles:
    """A store's images folder (created with its first image)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def put(self, image: bytes) -> str:
        """Keeps `image` (once) and returns its reference."""
        name = vision.digest(image) + _SUFFIX[vision.image_type(image)]
        target = self.folder / name
        if not target.exists():
            self.folder.mkdir(parents=True, exist_ok=True)
            handle, staging = tempfile.mkstemp(dir=self.folder, prefix=".", suffix=".part")
            with os.fdopen(handle, "wb") as out:
                out.write(image)
            os.replace(staging, target)
        return REF + name

    def get(self, ref: str) -> bytes:
        """The bytes of a reference `put` returned."""
        name = ref.removeprefix(REF)
        if name == ref or "/" in name or name.startswith("."):
            raise ValueError(f"not an image reference: {ref!r}")
        return (self.folder / name).read_bytes()

    def stash(self, messages: Sequence[Any]) -> list[Any]:
        """`messages` with every image data URL kept here and replaced by its reference."""
        return [_map_images(m, self._keep) for m in messages]

    def _keep(self, url: str) -> str:
        if url.startswith(REF):
            return url
        try:  # any size: a request's limits are the proxy's to enforce, not the store's
            return self.put(vision.decode_data_url(url, None))
        except vision.BadImage:  # not an image the policy can see: kept as it came
            return url

    def restore(self, messages: Sequence[Any]) -> list[Any]:
        """`messages` with every reference replaced by the data URL of its bytes (a URL kept
        inline stays as it is)."""
        return [_map_images(m, self._restored) for m in messages]

    def _restored(self, url: str) -> str:
        return vision.data_url(self.get(url)) if url.startswith(REF) else url


def _map_images(message: Any, change: Any) -> Any:
    """The message with each image part's URL changed by `change` (others untouched)."""
    content = message.get("content") if isinstance(message, Mapping) else None
    if not isinstance(content, list) or not any(
        isinstance(p, Mapping) and vision.part_url(p) for p in content
    ):
        return message
    return {**message, "content": [_map_part(p, change) for p in content]}


def _map_part(part: Any, change: Any) -> Any:
    url = vision.part_url(part) if isinstance(part, Mapping) else None
    if not url:
        return part
    if "image_url" in part:
        return {**part, "image_url": {**part["image_url"], "url": change(url)}}
    return {**part, "url": change(url)}
