"""systemd's notify protocol (``sd_notify(3)``): one datagram of ``KEY=VALUE`` lines per message.

systemd puts the socket's address in ``NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract
namespace) when the unit has ``Type=notify``. Without it every call is a cheap no-op, so the
gateway can always notify and still run anywhere. A failed send never raises: systemd being
gone is no reason to stop serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping

logger = logging.getLogger(__name__)


def _socket_address(value: str) -> str | None:
    if value.startswith("@"):
        # Abstract namespace: the name starts with a NUL byte instead of '@'.
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    if value:
        logger.debug("NOTIFY_SOCKET=%r is not a unix socket address; notifications disabled", value)
    return None


class SystemdNotifier:
    """Sends readiness, status and watchdog messages to systemd; does nothing outside systemd."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._address = _socket_address(env.get("NOTIFY_SOCKET", ""))
        self._watchdog_usec = env.get("WATCHDOG_USEC", "")
        self._watchdog_pid = env.get("WATCHDOG_PID", "")
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self._address is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between watchdog pings (half of ``WATCHDOG_USEC``), or None when not asked for.

        ``WATCHDOG_PID``, when set, names the process systemd watches; any other process
        (e.g. a child that inherited the environment) must not ping.
        """
        if self._watchdog_pid:
            try:
                if int(self._watchdog_pid) != os.getpid():
                    return None
            except ValueError:
                return None
        try:
            usec = int(self._watchdog_usec)
        except ValueError:
            return None
        if usec <= 0:
            return None
        return usec / 2 / 1_000_000

    def notify(self, **fields: str | int | bool) -> bool:
        """Send ``KEY=VALUE`` lines, keys upper-cased: ``notify(status="x")`` sends ``STATUS=x``.

        Returns whether the datagram went out; False outside systemd or when sending failed.
        """
        if self._address is None or not fields:
            return False
        lines = []
        for key, value in fields.items():
            text = str(int(value)) if isinstance(value, bool) else str(value)
            # One message per line: a newline in a value would start a bogus field.
            lines.append(f"{key.upper()}={text.replace(chr(10), ' ')}")
        payload = "\n".join(lines).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                # A full receive queue must not stall the event loop.
                self._sock.setblocking(False)
            self._sock.sendto(payload, self._address)
        except OSError as exc:
            logger.debug("sd_notify to %r failed: %s", self._address, exc)
            return False
        return True

    def ready(self) -> bool:
        return self.notify(READY=1)

    def status(self, text: str) -> bool:
        return self.notify(STATUS=text)

    def stopping(self) -> bool:
        return self.notify(STOPPING=1)

    def watchdog(self) -> bool:
        return self.notify(WATCHDOG=1)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


async def watchdog_loop(notifier: SystemdNotifier, is_healthy: Callable[[], bool]) -> None:
    """Ping systemd's watchdog every ``watchdog_interval`` seconds while ``is_healthy()`` holds.

    Pings stop while the gateway is unhealthy (or its event loop is wedged), so systemd's
    ``WatchdogSec=`` restarts it. Returns at once when systemd asked for no watchdog; otherwise
    runs until cancelled.
    """
    interval = notifier.watchdog_interval
    if interval is None:
        return
    while True:
        try:
            healthy = is_healthy()
        except Exception:
            logger.exception("health check for the systemd watchdog failed")
            healthy = False
        if healthy:
            notifier.watchdog()
        await asyncio.sleep(interval)


EXTEND_EVERY_SECONDS = 10.0  # how often a long start tells systemd what it is doing
EXTEND_BY_SECONDS = 30.0  # ... and how far past now its start timeout moves each time


async def extend_start_while(
    notifier: SystemdNotifier,
    describe: Callable[[], str | None],
    every: float = EXTEND_EVERY_SECONDS,
    extend_by: float = EXTEND_BY_SECONDS,
) -> None:
    """While ``describe()`` says what the start waits on (a download, a dequantization, the
    engine's boot), send it as ``STATUS=`` with ``EXTEND_TIMEOUT_USEC=`` every ``every``
    seconds; return once it says None (the gateway is ready, or gave up).

    Each message moves systemd's start timeout to ``extend_by`` seconds from now, so the
    unit's ``TimeoutStartSec=`` can stay modest: a first start that downloads 15 GB goes on
    while it makes progress, and one that hangs is still stopped soon after its last word.
    Returns at once outside systemd.
    """
    if not notifier.enabled:
        return
    while True:
        try:
            text = describe()
        except Exception:
            logger.exception("describing the start for systemd failed")
            text = "starting"
        if text is None:
            return
        notifier.notify(status=text[:200], extend_timeout_usec=int(extend_by * 1_000_000))
        await asyncio.sleep(every)
