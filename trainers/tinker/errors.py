"""The errors a Tinker call can blame on its caller."""

from __future__ import annotations


class UserError(ValueError):
    """Bad input from the client (unknown model or loss, malformed datum, wrong shapes):
    its future fails with category `user`, which the SDK raises as RequestFailedError."""


class NotFound(UserError):
    """A training run or checkpoint the REST routes were asked for does not exist: HTTP 404,
    which the SDK raises as NotFoundError."""


class TooMany(UserError):
    """A request past a per-owner count (training clients, queued futures): HTTP 429, which
    the SDK retries after a while."""


class QuotaExceeded(UserError):
    """A save past its owner's checkpoint quota (count or bytes): HTTP 403 (the SDK's
    PermissionDeniedError, which it does not retry: waiting frees nothing), or a `user`
    future error where the checkpoint's real size passes it."""


class TooLarge(UserError):
    """A request body past `max_body_bytes`: HTTP 413."""
