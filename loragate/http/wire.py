"""What goes on the wire: where a URL points and the bytes of a request's head.

A line break in a header name or value is refused here, for every request: it would end the
head and smuggle what follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import urlsplit

# scheme, host, port, and the Unix socket to connect to instead of host and port ("" for none)
Origin = tuple[str, str, int, str]


@dataclass(frozen=True)
class Target:
    origin: Origin
    request_line: bytes  # b"POST /v1/... HTTP/1.1\r\nHost: ...\r\n"


@lru_cache(maxsize=64)
def target(url: str, method: str = "POST", uds: str | None = None) -> Target:
    """Where to connect for ``url`` and the request's first two lines, parsed once per URL.

    With ``uds``, the connection goes to that Unix socket; the URL still gives the path and
    the Host header. Raises ``ValueError`` for anything but an ``http(s)://`` URL.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    if uds is not None and parts.scheme != "http":
        raise ValueError(f"{url!r}: a Unix socket carries plain http:// only")
    port = parts.port or (443 if parts.scheme == "https" else 80)  # a bad port raises here
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    host = parts.netloc.rpartition("@")[2]  # no credentials in the Host header
    line = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n".encode("latin-1")
    return Target((parts.scheme, parts.hostname, port, uds or ""), line)


def header_lines(headers: dict[str, str]) -> bytes:
    """``Name: value`` lines (CRLF-ended) for each header; a line break in one is refused."""
    lines = []
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}\r\n".encode("latin-1"))
    return b"".join(lines)


def request_bytes(target: Target, headers: dict[str, str], body: bytes) -> bytes:
    """A whole kept-alive request: the head with ``body``'s length, then ``body``."""
    length = b"Content-Length: %d\r\n" % len(body)
    return b"".join((target.request_line, length, header_lines(headers), b"\r\n", body))
