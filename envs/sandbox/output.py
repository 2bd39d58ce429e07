"""A command's output as the host reads it: capped at a number of bytes per stream (the
head and the tail are kept, a visible marker says how much was dropped), and split from
the marker line the shell prints when the command ends."""

from __future__ import annotations


def truncation_marker(omitted: int) -> bytes:
    """The line put where the output cap dropped bytes."""
    return f"\n[... {omitted} bytes of output omitted ...]\n".encode()


class CappedBuffer:
    """Keeps the head and the tail of a stream of at most `cap` bytes and counts the rest."""

    def __init__(self, cap: int):
        self.cap = cap
        self.tail_cap = cap // 4
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 4 * self.tail_cap:
                del self.tail[: -self.tail_cap]

    def value(self) -> tuple[bytes, int]:
        """The kept bytes (with a marker where some were dropped) and how many were dropped."""
        if self.total <= self.cap:
            return bytes(self.head), 0
        tail = bytes(self.tail[-self.tail_cap :]) if self.tail_cap else b""
        head = bytes(self.head[: self.cap - len(tail)])
        omitted = self.total - len(head) - len(tail)
        return head + truncation_marker(omitted) + tail, omitted


class StreamEnd:
    """Splits one stream into a command's output and the marker line that ends it."""

    def __init__(self, mark: bytes, cap: int):
        self.mark = mark
        self.output = CappedBuffer(cap)
        self.pending = bytearray()
        self.value: bytes | None = None

    def feed(self, data: bytes) -> None:
        if self.value is not None:
            return  # output of background processes after the command ended
        self.pending += data
        at = self.pending.find(self.mark)
        if at < 0:
            keep = len(self.mark) - 1
            if len(self.pending) > keep:
                self.output.add(bytes(self.pending[: len(self.pending) - keep]))
                del self.pending[: len(self.pending) - keep]
            return
        rest = self.pending[at + len(self.mark) :]
        newline = rest.find(b"\n")
        if newline < 0:
            return  # the marker line is not complete yet
        self.output.add(bytes(self.pending[:at]))
        self.value = bytes(rest[:newline])
        self.pending.clear()
