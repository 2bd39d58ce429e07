"""Directory trees carried out of one sandbox and into another, as tar archives.

Graders use them to judge an agent's work in a fresh sandbox started from the pristine
image, carrying over only the files the agent produced (never its processes, its shell,
its /tmp or anything it planted outside the directory graded). An archive holds only
directories, regular files and symbolic links, named relative to the directory exported;
links are recorded, never followed; fifos, sockets and devices are left out (a fifo the
agent left behind cannot hang the grader that reads it); ownership is dropped (the
importing sandbox owns what it unpacks). Every walk here is iterative, so a directory
nested a thousand levels deep is refused with a reason rather than a `RecursionError`.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from collections.abc import Callable, Iterable
from pathlib import Path

from envs.sandbox.records import SandboxError

MAX_TREE_BYTES = 512 * 1024 * 1024
"""Content a carried tree may hold; past it the tree is refused (a grader scores it 0)."""
MAX_TREE_ENTRIES = 200_000
"""Files, directories and links a carried tree may hold."""
MAX_TREE_DEPTH = 128
"""Directory levels below the exported directory (deeper is no source tree)."""


class TreeBudget:
    """Counts what an archive takes and refuses it past the limits, with the reason."""

    def __init__(self, where: str, max_bytes: int, max_entries: int):
        self.where, self.max_bytes, self.max_entries = where, max_bytes, max_entries
        self.bytes = self.entries = 0

    def add(self, name: str, size: int) -> None:
        self.entries += 1
        self.bytes += size
        if self.entries > self.max_entries:
            raise SandboxError(f"{self.where} holds more than {self.max_entries} entries")
        if self.bytes > self.max_bytes:
            limit = self.max_bytes // (1024 * 1024)
            raise SandboxError(f"{self.where} holds more than {limit} MB")
        if name.count("/") >= MAX_TREE_DEPTH:
            raise SandboxError(f"{self.where} nests directories deeper than {MAX_TREE_DEPTH}")


def pack_directory(
    root: Path,
    where: str,
    max_bytes: int = MAX_TREE_BYTES,
    max_entries: int = MAX_TREE_ENTRIES,
) -> bytes:
    """A host directory as an archive (see the module docstring); `where` names it in
    errors. A missing directory is an empty archive. The caller makes sure no process of
    the sandbox still writes there (a grader kills them first)."""
    budget = TreeBudget(where, max_bytes, max_entries)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        if not root.is_dir() or root.is_symlink():
            return _finish(tar, buffer)
        pending = [""]
        while pending:
            relative = pending.pop()
            try:
                entries = sorted(os.scandir(root / relative), key=lambda e: e.name)
            except OSError as error:
                raise SandboxError(f"cannot list {where}/{relative}: {error.strerror}") from None
            for entry in entries:
                name = f"{relative}/{entry.name}" if relative else entry.name
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # gone since the listing
                if stat.S_ISDIR(info.st_mode):
                    budget.add(name, 0)
                    tar.addfile(_info(name, tarfile.DIRTYPE, info.st_mode, info.st_mtime))
                    pending.append(name)
                elif stat.S_ISLNK(info.st_mode):
                    budget.add(name, 0)
                    member = _info(name, tarfile.SYMTYPE, info.st_mode, info.st_mtime)
                    member.linkname = os.readlink(entry.path)
                    tar.addfile(member)
                elif stat.S_ISREG(info.st_mode):
                    _add_file(tar, budget, name, entry.path, info.st_mode)
    return _finish(tar, buffer)


def _add_file(tar: tarfile.TarFile, budget: TreeBudget, name: str, path: str, mode: int) -> None:
    # O_NONBLOCK | O_NOFOLLOW and a second check on the open file: what was a file at the
    # listing may have become a fifo or a link since
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    with os.fdopen(fd, "rb") as handle:
        opened = os.fstat(handle.fileno())
        if not stat.S_ISREG(opened.st_mode):
            return
        budget.add(name, opened.st_size)
        member = _info(name, tarfile.REGTYPE, mode, opened.st_mtime)
        member.size = opened.st_size
        tar.addfile(member, handle)


def clean_archive(
    chunks: Iterable[bytes],
    where: str,
    strip: int = 0,
    max_bytes: int = MAX_TREE_BYTES,
    max_entries: int = MAX_TREE_ENTRIES,
) -> bytes:
    """An archive made by another tool (Docker's `get_archive`) reduced to what the module
    docstring allows, its names stripped of `strip` leading components."""
    raw = bytearray()
    for chunk in chunks:
        raw += chunk
        # the tar headers add up to a few hundred bytes per entry: room for them too
        if len(raw) > max_bytes + 1024 * max_entries:
            raise SandboxError(f"{where} holds more than {max_bytes // (1024 * 1024)} MB")
    return filter_archive(bytes(raw), where, lambda name: True, strip, max_bytes, max_entries)


def filter_archive(
    archive: bytes,
    where: str,
    keep: Callable[[str], bool],
    strip: int = 0,
    max_bytes: int = MAX_TREE_BYTES,
    max_entries: int = MAX_TREE_ENTRIES,
) -> bytes:
    """The members of `archive` whose (stripped) name `keep` accepts, of the allowed kinds."""
    budget = TreeBudget(where, max_bytes, max_entries)
    buffer = io.BytesIO()
    if not archive:  # nothing was there
        return _finish(tarfile.open(fileobj=buffer, mode="w"), buffer)
    with (
        tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as source,
        tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for member in source:
            name = "/".join(p for p in member.name.split("/")[strip:] if p and p != ".")
            if not name or ".." in name.split("/") or not keep(name):
                continue
            if not (member.isdir() or member.isreg() or member.issym()):
                continue
            budget.add(name, member.size if member.isreg() else 0)
            kind = member.type if member.type != tarfile.AREGTYPE else tarfile.REGTYPE
            copy = _info(name, kind, member.mode, member.mtime)
            copy.linkname, copy.size = member.linkname, member.size if member.isreg() else 0
            tar.addfile(copy, source.extractfile(member) if member.isreg() else None)
    return buffer.getvalue()


def unpack_directory(archive: bytes, root: Path, uid: int | None) -> None:
    """Unpacks an archive into a host directory, owned by `uid` when one is given.

    tarfile's "tar" filter keeps every member inside `root` (a member written through a
    link that leads out of it is left out); links themselves may point anywhere, as they
    resolve inside the sandbox, never on the host."""
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
        try:
            tar.extractall(root, filter=_inside)
        except (tarfile.TarError, OSError) as error:
            raise SandboxError(f"cannot unpack into the sandbox: {error}") from None
        names = [member.name for member in tar.getmembers()]
    if uid is not None:
        for name in names:
            os.lchown(root / name, uid, uid)


def _inside(member: tarfile.TarInfo, root: str) -> tarfile.TarInfo | None:
    try:
        return tarfile.tar_filter(member, root)
    except tarfile.FilterError:
        return None


def members(archive: bytes) -> list[tarfile.TarInfo]:
    """The members of an archive, in order."""
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
        return tar.getmembers()


def read_member(archive: bytes, name: str) -> bytes | None:
    """The content of one regular file of an archive, or None."""
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
        try:
            handle = tar.extractfile(name)
        except KeyError:
            return None
        return None if handle is None else handle.read()


def _info(name: str, kind: bytes, mode: int, mtime: float = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = stat.S_IMODE(mode) & 0o777  # no set-uid, set-gid or sticky bits carried
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = int(mtime)
    return info


def _finish(tar: tarfile.TarFile, buffer: io.BytesIO) -> bytes:
    tar.close()
    return buffer.getvalue()
