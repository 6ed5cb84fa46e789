"""Server-sent events off the wire: where each one ends, however the server ends its lines.

The SSE spec ends a line with CRLF, LF or CR, and an event with a blank line. vLLM writes LF,
sse-starlette CRLF, and a read may end anywhere, between a line end's CR and its LF too.
``EventSplitter`` cuts a stream into runs of whole events, for a relay that rewrites events
(which must never see half of one), and holds the start of an unfinished event, up to a cap;
``sse_lines`` and ``sse_data`` read a stream's events as a client does (``gateway chat``).
Each byte is searched once: a new read, with the last three bytes before it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from loragate.http.connection import UpstreamTooLarge

_LINE_END = rb"(?:\r\n|\r(?!\n)|\n)"
LINE_END = re.compile(_LINE_END)
EVENT_END = re.compile(_LINE_END * 2)  # a line's end, then an empty line's


def last_event_end(data: bytes) -> int:
    """Where the last whole event in ``data`` ends, or -1 if none does.

    A CR that ends ``data`` after an LF may be the first half of a CRLF whose LF comes in the
    next read: that event has not ended yet (a relay passing on its CR alone would end the
    next event's first line early). A CR after a CR ends one, so CR-only streams wait for
    nothing.
    """
    if data.endswith(b"\n\n") or data.endswith(b"\r\n\r\n"):  # vLLM's, sse-starlette's
        return len(data)
    last = before_last = -1
    for match in EVENT_END.finditer(data):
        before_last, last = last, match.end()
    if last == len(data) and data.endswith(b"\n\r"):
        return before_last
    return last


def event_around(events: bytes, at: int) -> tuple[int, int]:
    """Where the event holding offset ``at`` of ``events`` (whole events) starts and ends,
    its blank line included."""
    start = 0
    for match in EVENT_END.finditer(events):
        if match.end() > at:
            return start, match.end()
        start = match.end()
    return start, len(events)


class EventSplitter:
    """Reads in, whole events out; an event longer than ``max_event`` is refused."""

    __slots__ = ("_held", "_held_size", "_held_tail", "max_event")

    def __init__(self, max_event: int) -> None:
        self.max_event = max_event
        self._held: list[bytes] = []
        self._held_size = 0
        self._held_tail = b""  # the last three bytes held: where a split blank line starts

    def feed(self, chunk: bytes) -> bytes:
        """The events ``chunk`` completes (with the start held from before), b"" if none; the
        rest is held. Raises ``UpstreamTooLarge`` once more than ``max_event`` bytes of one
        event are held (and lets them go)."""
        tail = self._held_tail
        end = last_event_end(tail + chunk if tail else chunk)
        if end < len(tail):  # no event ends in it (none can end in what was held)
            self._hold(chunk)
            return b""
        cut = end - len(tail)
        events = chunk if cut == len(chunk) else chunk[:cut]
        if self._held:
            events = b"".join(self._held) + events
            self._let_go()
        self._hold(chunk[cut:])
        return events

    def rest(self) -> bytes:
        """What is held, at the stream's end: an event its server did not end."""
        rest = b"".join(self._held)
        self._let_go()
        return rest

    def _hold(self, piece: bytes) -> None:
        if not piece:
            return
        self._held.append(piece)
        self._held_size += len(piece)
        self._held_tail = (self._held_tail + piece[-3:])[-3:]
        if self._held_size > self.max_event:
            self._let_go()
            raise UpstreamTooLarge(self.max_event, "stream event")

    def _let_go(self) -> None:
        self._held.clear()
        self._held_size = 0
        self._held_tail = b""


# ----- read as a client -----------------------------------------------------------------------


def sse_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """The lines of an event stream's bytes, ended by ``\\n``, ``\\r\\n`` or ``\\r`` and by
    nothing else: a U+2028 or U+0085 in an event's JSON is text (``str.splitlines``, and
    httpx's ``iter_lines``, would cut the event there)."""
    pending = b""
    for chunk in chunks:
        pending += chunk
        # A \r at the end may be the first half of a \r\n: it waits for the next chunk.
        cut = len(pending) - 1 if pending.endswith(b"\r") else len(pending)
        *lines, rest = LINE_END.split(pending[:cut])
        pending = rest + pending[cut:]
        for line in lines:
            yield line.decode("utf-8", "replace")
    for line in LINE_END.split(pending) if pending else []:
        yield line.decode("utf-8", "replace")


def sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The ``data`` of each server-sent event in ``lines`` (an event's data lines joined by
    newlines; an event ends at an empty line)."""
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
            data = []
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)
