"""The real engine is reachable only through the gateway: its HTTP server listens on a Unix
socket in a 0700 directory under the cache dir, and on no TCP port."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import psutil
import pytest

from tests.gateway_process import GatewayProcess

pytestmark = [pytest.mark.engine]


def test_the_engine_http_server_listens_on_a_private_socket_and_no_tcp_port(
    gateway: GatewayProcess,
) -> None:
    info = gateway.engine_info()
    api_server = psutil.Process(int(info["pid"]))
    tcp = [c.laddr for c in api_server.net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert tcp == [], f"the engine's API server listens on TCP {tcp}"
    argv = api_server.cmdline()
    assert "--port" not in argv
    socket_path = Path(argv[argv.index("--uds") + 1])
    # The engine itself has bound it: a listening Unix socket of the API server.
    bound = {c.laddr for c in api_server.net_connections("unix") if c.laddr}
    assert str(socket_path) in bound
    assert stat.S_ISSOCK(os.stat(socket_path).st_mode)
    directory = os.stat(socket_path.parent)
    assert socket_path.parent == gateway.cache_dir / "engine-socket"
    assert stat.S_IMODE(directory.st_mode) == 0o700
    assert directory.st_uid == os.geteuid()
