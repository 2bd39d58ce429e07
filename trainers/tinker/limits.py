"""What one Tinker server lets its clients ask for: sizes, counts and connection timeouts,
each with its default (`tinker.limits.*` in `python -m trainers.tinker`; docs/serving.md)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class TinkerLimits:
    """The server's limits. Counts marked per owner hold for each API key (all clients are
    one owner on a server without keys)."""

    max_lora_rank: int = 64
    """A training client's LoRA rank (400 above it)."""
    max_seq_len: int = 8192
    """Tokens of a datum, or of a prompt plus max_tokens (400 above it); the model's own
    context (max_position_embeddings) caps it further."""
    max_num_samples: int = 64
    """Samples of one sample call (400 above it)."""
    max_tokens: int = 4096
    """A sample call's max_tokens (400 above it)."""
    max_body_bytes: int = 64 << 20
    """A request body (413 above it, refused while it is read: never held whole)."""
    max_training_clients: int = 8
    """Live training clients per owner (429 above it): a client's learner is freed when its
    session finishes or it is unloaded."""
    max_samplers: int = 256
    """Sampling sessions per owner; past it the owner's least recently used one is closed
    (its later use answers 404)."""
    max_queued: int = 64
    """Futures per owner waiting for the worker (429 above it; the SDK retries)."""
    max_checkpoints: int = 1000
    """Named checkpoints (`weights/NAME`, `sampler_weights/NAME`) per owner, over all their
    runs (403 past it; deleting one frees its place)."""
    max_checkpoint_bytes: int = 20 << 30
    """Bytes of an owner's named checkpoints (20 GiB; 403, or a failed save once its real
    size is known, past it)."""
    max_sampler_copies: int = 4
    """Checkpoints kept loaded for sampling (server-wide, least recently used dropped)."""
    idle_timeout_s: float = 30.0
    """A connection without a request under way is closed after this long."""
    request_timeout_s: float = 60.0
    """A request's head and body must arrive within this long of its first byte."""

    def __post_init__(self) -> None:
        for limit in fields(self):
            value = getattr(self, limit.name)
            if isinstance(value, bool) or not value > 0:
                raise ValueError(f"tinker.limits.{limit.name} must be positive, got {value!r}")
