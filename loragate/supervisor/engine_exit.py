"""How the engine's launcher ended, and waiting for that without blocking the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class ExitInfo:
    returncode: int
    at: float

    def describe(self) -> str:
        # The launcher reports a signal death of the engine as 128 + signal number.
        code = self.returncode
        if code < 0 or code > 128:
            signum = -code if code < 0 else code - 128
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(signum).name}"
        return f"exit code {code}"

    @property
    def is_error_exit(self) -> bool:
        """Exited with an error status of its own, not killed by a signal."""
        return 0 < self.returncode < 128


def exit_future(proc: subprocess.Popen[bytes]) -> asyncio.Future[int]:
    """A future for ``proc``'s exit code, from a daemon thread (never blocks interpreter exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[int] = loop.create_future()

    def settle(code: int) -> None:
        if not future.done():
            future.set_result(code)

    def wait() -> None:
        code = proc.wait()
        with contextlib.suppress(RuntimeError):  # the loop may be closed by now
            loop.call_soon_threadsafe(settle, code)

    threading.Thread(target=wait, name=f"engine-wait-{proc.pid}", daemon=True).start()
    return future
