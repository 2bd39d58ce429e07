"""Streaming a reply's text as its tokens arrive (the embedded engine's deltas)."""

from __future__ import annotations

from typing import Any


class Detokenizer:
    """Text deltas of a growing token sequence at a constant cost per token.

    Decoding the whole sequence at every token costs O(n^2) (150 ms of CPU for a
    512-token reply on SmolLM2's tokenizer, measured here). Only a window is decoded: from
    the start of the last emitted token's predecessor, so that tokenizers that render a
    token differently at the start of a text (a leading space) still give the right
    delta. Text is held back while it ends in an incomplete UTF-8 character.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        """Start of the decoded window."""
        self.read = 0
        """End of the text already emitted."""

    def push(self, token: int) -> str:
        self.ids.append(token)
        shown = self.tokenizer.decode(self.ids[self.prefix : self.read])
        window = self.tokenizer.decode(self.ids[self.prefix :])
        if len(window) <= len(shown) or window.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return window[len(shown) :]

    def rest(self) -> str:
        """The text of the tokens pushed but not yet emitted (the stream has ended)."""
        if self.read == len(self.ids):
            return ""
        shown = self.tokenizer.decode(self.ids[self.prefix : self.read])
        return self.tokenizer.decode(self.ids[self.prefix :])[len(shown) :]
