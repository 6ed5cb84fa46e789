"""TCP port checks that bind the way uvicorn does, so "free" here means uvicorn can bind it."""

from __future__ import annotations

import socket


def _family(host: str) -> socket.AddressFamily:
    # uvicorn's rule: an IPv6 literal contains ':'; anything else is bound as IPv4.
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def bind_error(host: str, port: int) -> OSError | None:
    """The error uvicorn would get binding ``host:port``, or None when the bind works.

    ``SO_REUSEADDR`` as uvicorn sets it: a port held only by TIME_WAIT connections counts as
    free, one with a listening socket does not.
    """
    try:
        with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        return exc
    return None


def port_is_free(host: str, port: int) -> bool:
    return bind_error(host, port) is None


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel considers free right now; another process may still take it first."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
