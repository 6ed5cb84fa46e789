"""What the gateway needs of its host: its port free to bind (the way its server binds it; if not,
who holds it) and its cache directory (adapters, logs, the engine's socket) writable.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import tempfile
from pathlib import Path

import psutil

from loragate.plan.preflight.problem import PreflightProblem


# Whether the cache directory (adapters, logs, the engine's socket) can be created and written.
def check_cache_dir(cache_dir: Path) -> PreflightProblem | None:
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache_dir, prefix=".preflight-") as probe:
            probe.write(b"ok")
            probe.flush()
    except (FileExistsError, NotADirectoryError):
        message = (
            f"The cache directory {cache_dir} cannot be created because it or a parent is a "
            "file: remove that file or pass --cache-dir with a writable directory."
        )
    except OSError as exc:
        message = (
            f"The cache directory {cache_dir} is not writable ({exc.strerror or exc}): fix "
            "its permissions or pass --cache-dir with a writable directory."
        )
    else:
        return None
    return PreflightProblem("cache_dir", message)


# The one way the gateway binds its port (``gateway.server`` listens on ``bound_socket``), so
# "free" here means the server can bind it.
def _family(host: str) -> socket.AddressFamily:
    # An IPv6 literal contains ':'; anything else (a name included) is bound as IPv4.
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening), or the ``OSError`` of binding.

    ``SO_REUSEADDR``: a port held only by TIME_WAIT connections counts as free, one with a
    listening socket does not.
    """
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def bind_error(host: str, port: int) -> OSError | None:
    """The error the gateway's server would get binding ``host:port``, or None when it binds."""
    try:
        bound_socket(host, port).close()
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


def _port_owner(port: int) -> str:
    """' by NAME (pid N)' for the process listening on ``port``, when this user may see it."""
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                if conn.pid is None:
                    return ""
                return f" by {psutil.Process(conn.pid).name()} (pid {conn.pid})"
    return ""


def check_port(host: str, port: int) -> PreflightProblem | None:
    if port == 0:
        return None
    error = bind_error(host, port)
    if error is None:
        return None
    if isinstance(error, socket.gaierror):
        message = (
            f"The host {host!r} does not resolve ({error.strerror}): pass --host with an "
            "address of this machine, e.g. 127.0.0.1 or 0.0.0.0."
        )
    elif error.errno == errno.EADDRINUSE:
        suggestion = ""
        with contextlib.suppress(OSError):
            suggestion = f" (e.g. --port {find_free_port(host)})"
        message = (
            f"Port {port} on {host} is already in use{_port_owner(port)}: stop that process "
            f"or pass --port with a free port{suggestion}."
        )
    elif error.errno in (errno.EACCES, errno.EPERM):
        message = (
            f"Listening on port {port} needs privileges this user lacks: pass --port with a "
            "port above 1023, or grant the gateway CAP_NET_BIND_SERVICE."
        )
    elif error.errno == errno.EADDRNOTAVAIL:
        message = (
            f"{host} is not an address of this machine: pass --host 127.0.0.1 (this machine "
            "only) or --host 0.0.0.0 (every interface)."
        )
    else:
        message = (
            f"The gateway cannot listen on {host}:{port} ({error.strerror or error}): pass "
            "another --host or --port."
        )
    return PreflightProblem("port", message)
