"""How few tokens a text can be, from its characters alone: `char_bound` proves, for a
tokenizer, the most characters one token stands for, so a prompt too long for the context
can be refused without tokenizing it (the embedded engine does, before the chat template
and the tokenizer take most of a second a megabyte on the proxy's event loop).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

NORMALIZER_SHRINK = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1}
"""Most characters of a text that one character of its normal form stands for: a composed
character stands for its canonical decomposition, at most 4 characters long (checked in the
tests)."""
KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "Sequence"}
"""Pre-tokenizers that drop no character of the text (unless told to remove matches)."""


@dataclass(frozen=True)
class CharBound:
    """How many characters of a text a tokenizer's tokens can stand for."""

    per_token: int
    """Most characters one token stands for."""
    dropped: str = ""
    """Characters that stand for no token: the tokenizer drops them."""

    def least_tokens(self, text: str) -> int:
        """Fewest tokens `text` can be."""
        kept = len(text) - sum(map(text.count, self.dropped))
        return -(-kept // self.per_token)


def char_bound(tokenizer: Any) -> CharBound | None:
    """How many characters a token can stand for; None where this function cannot prove a
    bound (then no prompt is refused by its length in characters).

    A BPE token stands for at most as many characters as its vocabulary string has: a
    byte-level string (GPT-2, SmolLM2, Qwen) spells one byte a character, and a character
    is at least a byte; other spellings only add characters ("▁" for a space, "<0x41>" for
    a byte). There is no bound where characters vanish before the model sees them: a
    normalizer that deletes or composes them (NFC: 4 for 1, allowed for), a pre-tokenizer
    that removes them (BERT's whitespace), an added token that swallows the spaces beside
    it, unknown characters fused into one token, or dropped for want of an unknown token
    (except bytes missing from a byte-level vocabulary, counted in `CharBound.dropped`).
    """
    if not tokenizer.is_fast:
        return None
    backend = tokenizer.backend_tokenizer
    normalizer = _component(backend.normalizer)
    shrink = 1 if normalizer is None else NORMALIZER_SHRINK.get(normalizer["type"])
    parts = list(_objects(_component(backend.pre_tokenizer)))
    if (
        shrink is None
        or type(backend.model).__name__ != "BPE"
        or backend.model.fuse_unk
        or any("type" in p and p["type"] not in KEEPING_PRE_TOKENIZERS for p in parts)
        or any(p.get("behavior") == "Removed" for p in parts)
        or any(t.lstrip or t.rstrip for t in tokenizer.added_tokens_decoder.values())
    ):
        return None
    vocab = tokenizer.get_vocab()
    dropped: str | None = ""
    if backend.model.unk_token is None:  # characters missing from the vocabulary vanish
        byte_level = any(p.get("type") == "ByteLevel" for p in parts)
        dropped = _dropped_bytes(vocab) if byte_level else None
    return None if dropped is None else CharBound(shrink * max(map(len, vocab)), dropped)


def _dropped_bytes(vocab: Mapping[str, int]) -> str | None:
    """The characters a byte-level vocabulary drops: those of one byte it does not spell
    (SmolLM2 lacks 6 control characters). None if it lacks a continuation byte: then a
    character of several bytes could vanish too."""
    missing = [byte for byte, char in bytes_to_unicode().items() if char not in vocab]
    if any(0x80 <= byte < 0xC0 for byte in missing):
        return None
    return "".join(chr(byte) for byte in missing if byte < 0x80)


def _component(part: Any) -> dict[str, Any] | None:
    """A tokenizers normalizer or pre-tokenizer as its JSON (None for none)."""
    return None if part is None else json.loads(part.__getstate__())


def _objects(spec: Any) -> Iterator[dict[str, Any]]:
    """Every JSON object in a tokenizers component's JSON (a Sequence's parts, say)."""
    if isinstance(spec, dict):
        yield spec
        spec = list(spec.values())
    if isinstance(spec, list):
        for item in spec:
            yield from _objects(item)


def request_chars(value: Any) -> int:
    """Characters of a request's messages or tools counted cheaply, as JSON would spell them
    at the least: each string's characters (keys included), a character for any other value.
    Only a first sieve: the embedded engine renders a request it finds over the bound."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(request_chars(k) + request_chars(v) for k, v in value.items())
    if isinstance(value, Sequence):
        return sum(map(request_chars, value))
    return 1
