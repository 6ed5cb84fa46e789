"""Whether the gateway can listen on its host and port, and if not, who holds the port."""

from __future__ import annotations

import contextlib
import errno
import socket

import psutil

from loragate.supervisor.ports import bind_error, find_free_port
from loragate.supervisor.preflight_problem import PreflightProblem


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
