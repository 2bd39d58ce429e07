"""API keys that name users: how the servers that serve several users read their keys, in
one place (the proxy's `serve.api_keys` / `serve.api_keys_file`, the Tinker server's
`tinker.api_keys` / `tinker.api_keys_file`).

An entry, in a config list or a line of a keys file, is `KEY` or `USER KEY` (whitespace
between). A user is 1-64 of `[A-Za-z0-9._-]`, starting with a letter or digit; several keys
may name one user (a key being rotated), and what a server keeps per user (the proxy's
sessions, the Tinker server's runs) is that user's whichever key it came with. A key alone
names a user of its own, `key-<16 hex digits>` (a hash of the key, so that what is stored
never holds a key). A keys file skips blank lines and lines starting with `#`. A key is
printable ASCII without spaces (it travels in an HTTP header); one key naming two users,
or a user name that could be another's (`local`, `key-...`), is refused.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from pathlib import Path

KEYLESS_USER = "local"
"""The one user of a server without keys (no key may name it)."""
_USER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_HASHED = re.compile(r"key-[0-9a-f]{16}")


def user_of_key(key: str) -> str:
    """The user a key alone names (stable across restarts and key order)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def read_keys(
    entries: Iterable[str], keys_file: str | Path | None = None, setting: str = "api_keys"
) -> dict[str, str]:
    """Each key of `entries` and of `keys_file`'s lines, with the user it names.

    Args:
        entries: `KEY` or `USER KEY` each.
        keys_file: a file of such entries, one a line (None: none).
        setting: the config setting read, for the errors.

    Raises:
        ValueError: an empty or malformed entry, a key naming two users, a reserved user
            name, or a keys file that cannot be read.
    """
    given = [(setting, entry) for entry in entries]
    if keys_file is not None:
        try:
            lines = Path(keys_file).read_text().splitlines()
        except OSError as error:
            raise ValueError(f"{setting}_file: cannot read {keys_file}: {error}") from None
        given += [
            (f"{keys_file}:{number}", line)
            for number, line in enumerate(lines, 1)
            if line.strip() and not line.lstrip().startswith("#")
        ]
    users: dict[str, str] = {}
    for where, entry in given:
        key, user = _parse(entry, where)
        if users.setdefault(key, user) != user:
            raise ValueError(f"{where}: a key names both {users[key]!r} and {user!r}")
    return users


def _parse(entry: str, where: str) -> tuple[str, str]:
    """`(key, user)` of one entry."""
    parts = str(entry).split()
    if len(parts) not in (1, 2):
        raise ValueError(
            f"{where}: an entry is KEY or USER KEY, got {len(parts)} words"
            + (" (an empty key)" if not parts else "")
        )
    key = parts[-1]
    if not (key.isascii() and key.isprintable()):
        raise ValueError(f"{where}: a key is printable ASCII (it is sent in an HTTP header)")
    if len(parts) == 1:
        return key, user_of_key(key)
    user = parts[0]
    if not _USER.fullmatch(user) or user == KEYLESS_USER or _HASHED.fullmatch(user):
        raise ValueError(
            f"{where}: a user is 1-64 of [A-Za-z0-9._-] starting with a letter or digit, and "
            f"not {KEYLESS_USER!r} nor key-<16 hex digits> (the names of keyless and unnamed "
            f"keys' users); got {user[:70]!r}"
        )
    return key, user
