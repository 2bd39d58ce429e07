"""The Tinker server's JSON bodies read field by field: each field of the type it must have,
or a `UserError` (HTTP 400, the SDK's BadRequestError) that names it, never a conversion
that fails inside a route as a server error."""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import Request

from trainers.tinker.errors import UserError
from trainers.tinker.sampling import SamplingParams


async def json_body(request: Request) -> dict:
    """The body as a JSON object (nesting too deep for the parser is malformed too)."""
    raw = await request.body()  # past max_body_bytes: TooLarge (413), not malformed
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise UserError(f"malformed JSON body: {type(error).__name__}") from error
    if not isinstance(body, dict):
        raise UserError("the JSON body must be an object")
    return body


def integer(value: Any, name: str, low: int = -(2**63), high: int = 2**63 - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UserError(f"{name} must be an integer from {low} to {high}, got {value!r}")
    return value


def number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise UserError(f"{name} must be true or false, got {value!r}")
    return value


def text(value: Any, name: str, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise UserError(f"{name} must be a string, got {value!r}")
    return value


def lora(raw: Any) -> tuple[int, int | None, bool, bool]:
    """A lora_config's (rank, seed, train_attn, train_mlp)."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise UserError("lora_config must be an object")
    seed = raw.get("seed")
    return (
        integer(raw.get("rank", 32), "lora_config.rank"),
        None if seed is None else integer(seed, "lora_config.seed"),
        flag(raw.get("train_attn", True), "lora_config.train_attn"),
        flag(raw.get("train_mlp", True), "lora_config.train_mlp"),
    )


ADAM = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


def adam(raw: Any) -> dict[str, float]:
    if not isinstance(raw, dict):
        raise UserError("optim_step needs adam_params; other optimizers are not served")
    return {k: number(raw[k], f"adam_params.{k}") for k in ADAM if raw.get(k) is not None}


def prompt_tokens(prompt: Any) -> list[int]:
    """The token ids of a ModelInput's encoded_text chunks."""
    chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
    if not isinstance(chunks, list):
        raise UserError("prompt must be a ModelInput with chunks")
    tokens: list[int] = []
    for chunk in chunks:
        if not isinstance(chunk, dict) or chunk.get("type") != "encoded_text":
            raise UserError("only encoded_text prompt chunks are served")
        ids = chunk.get("tokens", [])
        if not isinstance(ids, list):
            raise UserError("a chunk's tokens must be a list of token ids")
        tokens.extend(integer(t, "a prompt token", 0, 2**31 - 1) for t in ids)
    return tokens


def sampling_params(raw: Any) -> SamplingParams:
    if not isinstance(raw, dict):
        raise UserError("sampling_params must be an object")
    stop = raw.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, (int, str)) for s in stop):
        raise UserError("sampling_params.stop must be a string or a list of strings or ids")
    seed = raw.get("seed")
    return SamplingParams(
        max_tokens=integer(raw.get("max_tokens"), "sampling_params.max_tokens", 0),
        temperature=number(raw.get("temperature", 1.0), "sampling_params.temperature"),
        top_k=integer(raw.get("top_k", -1), "sampling_params.top_k", -1),
        top_p=number(raw.get("top_p", 1.0), "sampling_params.top_p"),
        seed=None if seed is None else integer(seed, "sampling_params.seed"),
        stop_tokens=tuple(s for s in stop if isinstance(s, int) and not isinstance(s, bool)),
        stop_strings=tuple(s for s in stop if isinstance(s, str)),
    )
