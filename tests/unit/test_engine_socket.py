"""The engine is reachable only through the gateway: a Unix socket in a private directory.

A TCP port on loopback answered any local user on the paths vLLM's key does not guard, and a
port picked before the engine bound it could be taken first by another process, which then
received the per-boot key. These tests pin the socket design on the stand-in engine; the
real engine's version is tests/integration/test_engine_socket.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest
import pytest_asyncio

from loragate.engine_states import EngineState
from loragate.gateway.proxy import ProxyClient, UpstreamUnreachable
from loragate.http import oneshot
from loragate.settings.supervision import SupervisionFields
from loragate.supervisor.client import EngineClient
from loragate.supervisor.command import EngineSpec, engine_argv
from loragate.supervisor.engine import EngineSupervisor
from loragate.supervisor.unix_socket import (
    MAX_SOCKET_PATH,
    EngineSocket,
    EngineSocketError,
)
from tools.bench.fake_engine import FakeEngine, start_unix_server

FAKE_ENGINE = [sys.executable, "-m", "tools.bench.fake_engine"]
FAST = SupervisionFields(
    startup_timeout=30, probe_interval=0.2, probe_timeout=0.5, restart_backoff=0.05,
    restart_backoff_max=0.2, stop_timeout=5,
)  # fmt: skip


def supervisor(cache_dir: Path) -> EngineSupervisor:
    def build(socket_path: Path, api_key: str) -> EngineSpec:
        return EngineSpec(
            model="fake", served_name="fake", socket_path=socket_path, api_key=api_key,
            max_loras=1, max_lora_rank=8, command=FAKE_ENGINE,
        )  # fmt: skip

    return EngineSupervisor(build, cache_dir=cache_dir, timings=FAST)


def tree(sup: EngineSupervisor) -> list[psutil.Process]:
    assert sup.launcher_pid is not None
    launcher = psutil.Process(sup.launcher_pid)
    return [launcher, *launcher.children(recursive=True)]


class Squatter:
    """A listener at the engine's socket path that records every connection it is offered."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen()
        self.sock.settimeout(0.1)
        self.received: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(1)
                try:
                    self.received.append(conn.recv(65536))
                except OSError:
                    self.received.append(b"")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest_asyncio.fixture(loop_scope="function")
async def running(tmp_path: Path) -> AsyncIterator[EngineSupervisor]:
    sup = supervisor(tmp_path)
    await sup.start()
    try:
        await sup.wait_until_serving(30)
        yield sup
    finally:
        await sup.stop()


@pytest.fixture()
def short_tmp() -> Iterator[Path]:
    # pytest's tmp_path can be long; a socket path must fit in 107 bytes.
    with tempfile.TemporaryDirectory(prefix="lg-") as name:
        yield Path(name)


def test_engine_argv_listens_on_the_socket_and_names_no_port(tmp_path: Path) -> None:
    spec = EngineSpec(
        model="m", served_name="m", socket_path=tmp_path / "engine-socket" / "engine.sock",
        api_key="secret", max_loras=1, max_lora_rank=8,
    )  # fmt: skip
    argv = engine_argv(spec)
    assert argv[argv.index("--uds") + 1] == str(tmp_path / "engine-socket" / "engine.sock")
    assert "--port" not in argv and "--host" not in argv
    assert "secret" not in " ".join(argv)


async def test_the_engine_listens_on_a_socket_in_a_private_dir_and_on_no_tcp_port(
    running: EngineSupervisor, tmp_path: Path
) -> None:
    endpoint = running.endpoint
    assert endpoint is not None
    directory = tmp_path / "engine-socket"
    assert endpoint.uds == str(directory / "engine.sock")
    info = os.stat(directory)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
    assert stat.S_ISSOCK(os.stat(endpoint.uds).st_mode)
    processes = tree(running)
    engine = psutil.Process(running.engine_pid or 0)
    argv = engine.cmdline()
    assert argv[argv.index("--uds") + 1] == endpoint.uds and "--port" not in argv
    for proc in processes:
        listening = [c for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN]
        assert listening == [], (proc.cmdline(), listening)


async def test_every_engine_client_goes_over_the_socket(running: EngineSupervisor) -> None:
    endpoint = running.endpoint
    assert endpoint is not None and endpoint.base_url == "http://engine"
    health = await oneshot.request(
        "GET", endpoint.base_url + "/health", timeout=5, uds=endpoint.uds
    )
    assert health.status == 200
    client = EngineClient(running)
    try:
        assert await client.served_ids() == {"fake"}
    finally:
        await client.aclose()
    proxy = ProxyClient()
    try:
        answer = await proxy.forward(
            endpoint.base_url + "/v1/completions",
            b'{"model":"fake","prompt":"hi","max_tokens":1}',
            {**endpoint.headers, "Content-Type": "application/json"},
            stream=False,
            rename=None,
            on_done=lambda: None,
            uds=endpoint.uds,
        )
        assert answer.status_code == 200
    finally:
        await proxy.aclose()


@pytest.mark.parametrize("squatter", ["listening socket", "regular file"])
async def test_something_at_the_socket_path_before_boot_never_sees_the_key(
    short_tmp: Path, squatter: str
) -> None:
    directory = short_tmp / "engine-socket"
    directory.mkdir()
    directory.chmod(0o777)  # left open to everyone, as if another user could have got in
    path = directory / "engine.sock"
    listener = Squatter(path) if squatter == "listening socket" else None
    if listener is None:
        path.write_text("not a socket")
    sup = supervisor(short_tmp)
    await sup.start()
    try:
        await sup.wait_until_serving(30)
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        client = EngineClient(sup)
        try:
            assert await client.served_ids() == {"fake"}  # sends the per-boot key
        finally:
            await client.aclose()
        assert sup.endpoint is not None
        health = await oneshot.request(
            "GET", "http://engine/health", timeout=5, uds=sup.endpoint.uds
        )
        assert health.status == 200
    finally:
        await sup.stop()
        if listener is not None:
            listener.close()
    if listener is not None:
        assert listener.received == []


async def test_a_symlinked_socket_dir_is_refused_before_any_engine_starts(
    short_tmp: Path,
) -> None:
    elsewhere = short_tmp / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (short_tmp / "engine-socket").symlink_to(elsewhere)
    sup = supervisor(short_tmp)
    await sup.start()
    try:
        await _wait_state(sup, EngineState.FAILED)
        assert "not a directory" in sup.reason
        assert sup.launcher_pid is None
    finally:
        await sup.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory away")
async def test_a_socket_dir_owned_by_another_user_is_refused(short_tmp: Path) -> None:
    directory = short_tmp / "engine-socket"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)
    sup = supervisor(short_tmp)
    await sup.start()
    try:
        await _wait_state(sup, EngineState.FAILED)
        assert "belongs to uid 65534" in sup.reason
        assert sup.launcher_pid is None
    finally:
        await sup.stop()


def test_a_cache_dir_too_long_for_a_socket_gets_a_private_temporary_dir(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    where = EngineSocket(deep)
    path = where.path_for_boot()
    assert len(os.fsencode(path)) <= MAX_SOCKET_PATH
    assert not str(path).startswith(str(deep))
    info = os.stat(path.parent)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
    where.remove()
    assert not path.parent.exists()


def test_a_directory_at_the_socket_path_is_an_error(short_tmp: Path) -> None:
    (short_tmp / "engine-socket" / "engine.sock").mkdir(parents=True)
    with pytest.raises(EngineSocketError, match="is a directory"):
        EngineSocket(short_tmp).path_for_boot()


async def test_a_missing_socket_is_unreachable_not_a_crash(short_tmp: Path) -> None:
    proxy = ProxyClient()
    try:
        with pytest.raises(UpstreamUnreachable):
            await proxy.forward(
                "http://engine/v1/completions", b"{}", {}, stream=False, rename=None,
                on_done=lambda: None, uds=str(short_tmp / "nothing.sock"),
            )  # fmt: skip
    finally:
        await proxy.aclose()
    with pytest.raises(oneshot.PlainHTTPError, match="not reachable"):
        await oneshot.request(
            "GET", "http://engine/health", timeout=2, uds=str(short_tmp / "nothing.sock")
        )


async def test_the_fake_engine_answers_on_a_unix_socket(short_tmp: Path) -> None:
    server = await start_unix_server(FakeEngine(api_key=None, models=["m"]), str(short_tmp / "s"))
    async with server:
        answer = await oneshot.request(
            "GET", "http://engine/v1/models", timeout=5, uds=str(short_tmp / "s")
        )
    assert answer.status == 200 and answer.json()["data"][0]["id"] == "m"


async def _wait_state(sup: EngineSupervisor, state: EngineState, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while sup.state != state:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{sup.state}: {sup.reason}")
        await asyncio.sleep(0.05)
