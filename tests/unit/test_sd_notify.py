from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from loragate.systemd import SystemdNotifier, watchdog_loop

# sockaddr_un holds 108 bytes; pytest's tmp_path for a long test name can exceed that.
_MAX_SOCKET_PATH = 100


@pytest.fixture
def socket_dir(tmp_path: Path) -> Iterator[Path]:
    if len(str(tmp_path / "notify.sock")) <= _MAX_SOCKET_PATH:
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(prefix="sd-", dir="/tmp") as short:
        yield Path(short)


@pytest.fixture
def systemd(socket_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A datagram socket standing in for systemd, its path in NOTIFY_SOCKET."""
    path = socket_dir / "notify.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(path))
    server.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    yield server
    server.close()


def received(server: socket.socket, count: int) -> list[str]:
    return [server.recv(4096).decode() for _ in range(count)]


def pending(server: socket.socket) -> list[bytes]:
    """Every datagram already queued, without waiting for more."""
    timeout = server.gettimeout()
    server.setblocking(False)
    datagrams = []
    try:
        while True:
            datagrams.append(server.recv(4096))
    except BlockingIOError:
        return datagrams
    finally:
        server.settimeout(timeout)


def test_sends_ready_status_watchdog_stopping_in_order(systemd: socket.socket) -> None:
    notifier = SystemdNotifier()
    assert notifier.ready()
    assert notifier.status("engine ready, 2 adapters")
    assert notifier.watchdog()
    assert notifier.stopping()
    assert received(systemd, 4) == [
        "READY=1",
        "STATUS=engine ready, 2 adapters",
        "WATCHDOG=1",
        "STOPPING=1",
    ]
    notifier.close()


def test_notify_sends_every_field_in_one_datagram(systemd: socket.socket) -> None:
    notifier = SystemdNotifier()
    assert notifier.notify(ready=True, status="serving", extend_timeout_usec=5_000_000)
    assert received(systemd, 1) == ["READY=1\nSTATUS=serving\nEXTEND_TIMEOUT_USEC=5000000"]
    notifier.close()


def test_status_with_a_newline_stays_one_field(systemd: socket.socket) -> None:
    notifier = SystemdNotifier()
    notifier.status("engine failed:\nout of memory")
    assert received(systemd, 1) == ["STATUS=engine failed: out of memory"]
    notifier.close()


def test_abstract_namespace_socket_receives_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"loragate-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind("\0" + name)
        server.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        notifier = SystemdNotifier()
        assert notifier.ready()
        assert server.recv(4096) == b"READY=1"
        notifier.close()


def test_without_notify_socket_every_call_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)

    def no_socket(*args: object, **kwargs: object) -> socket.socket:
        raise AssertionError("no socket may be opened outside systemd")

    monkeypatch.setattr(socket, "socket", no_socket)
    notifier = SystemdNotifier()
    assert not notifier.enabled
    assert not notifier.ready()
    assert not notifier.status("x")
    assert not notifier.watchdog()
    assert not notifier.stopping()


def test_send_to_a_missing_socket_returns_false_without_raising(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    notifier = SystemdNotifier()
    assert notifier.enabled
    assert not notifier.ready()
    notifier.close()


def test_relative_notify_socket_is_ignored() -> None:
    assert not SystemdNotifier({"NOTIFY_SOCKET": "notify.sock"}).enabled


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    notifier = SystemdNotifier({"WATCHDOG_USEC": "60000000"})
    assert notifier.watchdog_interval == 30.0


def test_watchdog_interval_applies_when_watchdog_pid_is_ours() -> None:
    notifier = SystemdNotifier({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": str(os.getpid())})
    assert notifier.watchdog_interval == 5.0


def test_watchdog_is_off_when_watchdog_pid_names_another_process() -> None:
    notifier = SystemdNotifier({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": str(os.getpid() + 1)})
    assert notifier.watchdog_interval is None


@pytest.mark.parametrize("usec", ["", "0", "-5", "soon"])
def test_watchdog_is_off_without_a_valid_watchdog_usec(usec: str) -> None:
    assert SystemdNotifier({"WATCHDOG_USEC": usec}).watchdog_interval is None


async def test_watchdog_loop_pings_only_while_healthy(
    systemd: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "20000")  # a ping every 10 ms
    notifier = SystemdNotifier()
    systemd.setblocking(False)
    loop = asyncio.get_running_loop()
    healthy = True

    async def next_datagram() -> bytes:
        return await asyncio.wait_for(loop.sock_recv(systemd, 4096), timeout=5)

    task = asyncio.create_task(watchdog_loop(notifier, lambda: healthy))
    try:
        for _ in range(3):
            assert await next_datagram() == b"WATCHDOG=1"
        healthy = False
        await asyncio.sleep(0.05)  # a ping decided on before the change may still land
        pending(systemd)
        await asyncio.sleep(0.2)  # twenty intervals
        assert pending(systemd) == []
        healthy = True
        assert await next_datagram() == b"WATCHDOG=1"
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        notifier.close()


async def test_watchdog_loop_stops_pinging_when_the_health_check_raises(
    systemd: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "20000")
    notifier = SystemdNotifier()

    def broken() -> bool:
        raise RuntimeError("health unknown")

    task = asyncio.create_task(watchdog_loop(notifier, broken))
    await asyncio.sleep(0.1)
    assert pending(systemd) == []
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    notifier.close()


async def test_watchdog_loop_returns_at_once_without_a_watchdog(
    systemd: socket.socket,
) -> None:
    notifier = SystemdNotifier()
    await asyncio.wait_for(watchdog_loop(notifier, lambda: True), timeout=1)
    assert pending(systemd) == []
    notifier.close()
