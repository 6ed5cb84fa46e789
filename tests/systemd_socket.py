"""systemd's side of ``NOTIFY_SOCKET`` for the tests: a real AF_UNIX datagram socket whose
every datagram a thread reads at once, as systemd does (an unread queue holds only a few: the
gateway's later ones would be dropped; progress comes every 10 s during a boot)."""

from __future__ import annotations

import asyncio
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class NotifySocket:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                self.messages.append(self.sock.recv(65536).decode())
            except TimeoutError:
                continue
            except OSError:  # closed
                return

    def close(self) -> None:
        self.sock.close()

    def index(self, line: str) -> int | None:
        """The first datagram with a line starting with ``line``, or None."""
        for at, message in enumerate(list(self.messages)):
            if any(field.startswith(line) for field in message.split("\n")):
                return at
        return None

    async def wait_for(self, line: str, timeout: float = 30) -> int:
        """The index of the first datagram with ``line``, once one came (within ``timeout``)."""
        deadline = time.monotonic() + timeout
        while (at := self.index(line)) is None:
            assert time.monotonic() < deadline, f"no {line!r} among {self.messages}"
            await asyncio.sleep(0.02)
        return at

    def wait(self, line: str, timeout: float = 60) -> int:
        """``wait_for``, from a test that runs no event loop."""
        return asyncio.run(self.wait_for(line, timeout))


@contextmanager
def notify_socket() -> Iterator[NotifySocket]:
    """A ``NotifySocket`` under ``/tmp``: a socket's path holds 108 bytes, and pytest's
    ``tmp_path`` may be longer."""
    with tempfile.TemporaryDirectory(prefix="sd-", dir="/tmp") as short:
        notify = NotifySocket(Path(short) / "notify.sock")
        try:
            yield notify
        finally:
            notify.close()
