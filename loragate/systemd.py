"""systemd, both ways: the notify protocol by which the gateway tells systemd how it is
(``READY=1``, ``STATUS=``, the watchdog), and the ``Type=notify`` unit ``gateway systemd-unit``
writes for this install.

systemd hears from the process, not from a backend: ``SystemdReporter`` is the gateway
process's one voice (the app's lifespan drives it), whatever serves behind it; a backend whose
start outlasts its ``start()`` says how it goes through ``ReportsStart``.

``KillMode=mixed`` sends SIGTERM to the gateway alone, which stops the engine tree itself
(gracefully, in order); only what is left after ``TimeoutStopSec`` gets SIGKILL from systemd.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import socket
import sys
from collections.abc import Callable, Collection, Coroutine, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

# systemd's notify protocol (``sd_notify(3)``): one datagram of ``KEY=VALUE`` lines per message.
#
# systemd puts the socket's address in ``NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract
# namespace) when the unit has ``Type=notify``. Without it every call is a cheap no-op, so the
# gateway can always notify and still run anywhere. A failed send never raises: systemd being
# gone is no reason to stop serving.
logger = logging.getLogger(__name__)
# After a start gave up (its engine failed), how often to ask whether it serves now (an
# admin's restart): READY=1 then, as systemd waits for it until TimeoutStartSec.
_SERVING_AGAIN_SECONDS = 2.0


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


class ServiceStart(Protocol):
    """How a backend's start goes, as ``SystemdReporter`` tells systemd."""

    async def until_serving(self) -> bool:
        """Return once the start is over: True when the backend serves, False when it gave up
        (it could not be prepared, or its engine failed)."""
        ...

    def describe_start(self) -> str | None:
        """What the start waits on now, in one line (a download, an engine's boot); None when
        there is nothing left to wait for."""
        ...

    def add_status_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener`` with one line on each change of state, from now on."""
        ...


@runtime_checkable
class ReportsStart(Protocol):
    """A backend whose start goes on after its ``start()`` returns: an engine prepares and
    boots, a catalog's models are prepared and preloaded. One without it serves once started
    (an upstream URL, a custom backend)."""

    def service_start(self) -> ServiceStart: ...


class AllStarts:
    """Several models' starts as one (a catalog's). It serves once every model's start is over
    and one of them serves (a cold model serves: the next request boots it), the tasks in
    ``first`` (the preloads, which boot their engines) done before; each line names its
    model."""

    def __init__(
        self, parts: Mapping[str, ServiceStart], first: Collection[asyncio.Future[Any]] = ()
    ) -> None:
        self.parts = parts
        self.first = first  # may still change: a preload leaves its set when done
        self._listeners: list[Callable[[str], None]] = []
        self._last_line: str | None = None

    async def until_serving(self) -> bool:
        pending = list(self.first)
        if pending:
            await asyncio.wait(pending)  # not gather: a cancelled wait leaves the preloads be
        names = list(self.parts)
        results = await asyncio.gather(*(self.parts[name].until_serving() for name in names))
        serving = [name for name, ok in zip(names, results, strict=True) if ok]
        failed = [name for name, ok in zip(names, results, strict=True) if not ok]
        line = "serving " + ", ".join(serving) if serving else "no model could start"
        if failed:
            line += "; failed: " + ", ".join(failed)
        if line != self._last_line:  # asked again after giving up: said once
            self._last_line = line
            for listener in self._listeners:
                listener(line)
        return bool(serving)

    def describe_start(self) -> str | None:
        lines = []
        for name, part in self.parts.items():
            text = part.describe_start()
            if text is not None:
                lines.append(f"{name}: {text}")
        if not lines and any(not task.done() for task in self.first):
            return "loading the preloaded models"  # between a model's prepare and its boot
        return "; ".join(lines) or None

    def add_status_listener(self, listener: Callable[[str], None]) -> None:
        self._listeners.append(listener)
        for name, part in self.parts.items():
            part.add_status_listener(functools.partial(_named_line, listener, name))


def _named_line(listener: Callable[[str], None], name: str, line: str) -> None:
    listener(f"{name}: {line}")


class SystemdReporter:
    """The gateway process's life as systemd hears it, whatever serves behind it.

    ``READY=1`` once the backend serves: when its ``ServiceStart`` says so (one model: its
    engine is ready; a catalog: every model prepared, its preloads booted), else as soon as
    its ``start()`` returned (an upstream URL, a custom backend). Meanwhile ``STATUS=`` with
    the start's progress and ``EXTEND_TIMEOUT_USEC=`` every ``EXTEND_EVERY_SECONDS``
    (``extend_start_while``), and a ``STATUS=`` line on each change the backend reports.
    ``WATCHDOG=1`` while the event loop answers; ``STOPPING=1`` when the stop begins.
    Outside systemd (no ``NOTIFY_SOCKET``) it does nothing at all.
    """

    def __init__(self, notifier: SystemdNotifier | None = None) -> None:
        self.notifier = SystemdNotifier() if notifier is None else notifier
        self._start: ServiceStart | None = None
        self._start_over = False  # served, or gave up: nothing more to extend
        self._tasks: set[asyncio.Task[None]] = set()

    def starting(self, backend: object) -> None:
        """Before ``backend`` starts: its status lines and its start's progress, and the
        watchdog."""
        if not self.notifier.enabled:
            return
        self._start_over = False
        if isinstance(backend, ReportsStart):
            self._start = backend.service_start()
            self._start.add_status_listener(self._status)
            self._spawn(extend_start_while(self.notifier, self._describe_start), "start-notes")
        if self.notifier.watchdog_interval is not None:
            # The gateway's event loop answering is what systemd's watchdog checks.
            self._spawn(watchdog_loop(self.notifier, lambda: True), "systemd-watchdog")

    def started(self) -> None:
        """The backend's ``start()`` returned: ``READY=1`` once it serves."""
        if self.notifier.enabled:
            self._spawn(self._ready_once_serving(), "systemd-ready")

    async def stop(self) -> None:
        """``STOPPING=1``, and no more progress, readiness or watchdog pings."""
        self.notifier.stopping()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _status(self, line: str) -> None:
        self.notifier.status(line[:200])

    def _describe_start(self) -> str | None:
        if self._start_over or self._start is None:
            return None
        return self._start.describe_start()

    async def _ready_once_serving(self) -> None:
        gave_up = False
        while True:
            try:
                serving = self._start is None or await self._start.until_serving()
            except Exception:
                logger.exception("waiting for the backend to serve, for systemd, failed")
                serving = False
            self._start_over = True
            if serving:
                self.notifier.ready()
                return
            if not gave_up:  # an admin's restart may still bring it up: READY=1 then
                logger.warning("the backend's start gave up: systemd is not told READY=1")
                gave_up = True
            await asyncio.sleep(_SERVING_AGAIN_SECONDS)

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


_SAFE_WORD = re.compile(r"[A-Za-z0-9_@%+=:,./$-]+")
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escape_specifiers(text: str) -> str:
    # '%' starts a unit specifier (%h, %u, ...) in almost every setting.
    return text.replace("%", "%%")


def quote_exec_arg(arg: str) -> str:
    """One word of an ``ExecStart=`` line that systemd reads back as exactly ``arg``.

    systemd splits on whitespace, honours quotes around whole words, applies C escapes,
    expands ``$VAR`` and ``%`` specifiers; ``$$`` and ``%%`` are the literal characters.
    """
    escaped = arg.replace("%", "%%").replace("$", "$$")
    if _SAFE_WORD.fullmatch(arg):
        return escaped
    out = []
    for ch in escaped:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _single_line(name: str, value: str) -> str:
    if "\n" in value or "\r" in value:
        raise ValueError(f"{name} cannot contain a line break: {value!r}")
    return _escape_specifiers(value)


# Directories systemd creates for the service (owned by its User=) and names in
# $STATE_DIRECTORY and $CACHE_DIRECTORY, which loragate takes as its state dir (the runtime
# adapter manifest) and its cache dir (adapter store, models, logs): loragate.paths.
SERVICE_DIRECTORY = "loragate"

# The executable under one of these is out of reach with ProtectHome=yes.
_HOME_TREES = (Path("/home"), Path("/root"), Path("/run/user"))

# A system service's sandbox: what `systemd-analyze security` scores, each line one that vLLM
# runs under. Left out on purpose: PrivateDevices= (it hides /dev/nvidia* and /dev/dri, the
# GPUs), ProtectClock= and DeviceAllow= (either one closes the device list to the GPUs),
# MemoryDenyWriteExecute= (torch's and Triton's JIT compilers map memory writable and
# executable), ProcSubset=pid (vLLM reads /proc/meminfo and /proc/cpuinfo), an allow-list
# SystemCallFilter= (CUDA and NCCL need calls outside @system-service; NCCL uses pidfd_getfd,
# so @debug stays allowed too) and PrivateUsers= (it unmaps the video and render groups that
# may own the GPU devices).
_SANDBOX = [
    "NoNewPrivileges=yes",
    "ProtectSystem=strict",  # all read-only but /dev, /proc, /sys and the directories above
    "PrivateTmp=yes",
    "ProtectKernelTunables=yes",
    "ProtectKernelModules=yes",
    "ProtectKernelLogs=yes",
    "ProtectControlGroups=yes",
    "ProtectHostname=yes",
    "ProtectProc=invisible",
    "RestrictSUIDSGID=yes",
    "RestrictRealtime=yes",
    "RestrictNamespaces=yes",
    "PrivateMounts=yes",
    "LockPersonality=yes",
    "RemoveIPC=yes",
    "SystemCallArchitectures=native",
    # Calls an inference server never makes; refused with EPERM rather than a kill.
    "SystemCallFilter=~@clock @cpu-emulation @module @mount @obsolete @raw-io @reboot @swap",
    "SystemCallErrorNumber=EPERM",
    "CapabilityBoundingSet=",
    "AmbientCapabilities=",
    # AF_NETLINK: the interface queries of torch.distributed and NCCL.
    "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
    "UMask=0027",
]


def render_unit(
    *,
    exec_start: list[str],
    working_directory: Path | None = None,
    user: str | None,
    environment_file: Path | None,
    user_mode: bool,
) -> str:
    """The text of a ``loragate.service`` unit.

    A system unit runs as ``user`` (and the group of that name) in the sandbox above, with its
    state in ``/var/lib/loragate`` and its cache in ``/var/cache/loragate``; its working
    directory is the state directory unless ``working_directory`` says otherwise.
    ``user_mode`` renders a unit for ``systemctl --user``: no ``User=``, no dependency on the
    system's ``network-online.target`` (a user manager cannot order against it), no sandbox
    but ``NoNewPrivileges=`` (the rest needs user namespaces there), its directories under
    ``~/.local/state`` and ``~/.cache``, and ``WantedBy=default.target``. Raises ValueError
    for settings systemd would reject.
    """
    if not exec_start:
        raise ValueError("exec_start is empty: give the command that runs `gateway serve`")
    executable = Path(exec_start[0])
    if not executable.is_absolute():
        raise ValueError(f"ExecStart needs an absolute executable path, not {exec_start[0]!r}")
    if user_mode and user is not None:
        raise ValueError("User= has no meaning in a user unit: drop the user or the user mode")
    if user in ("root", "0"):
        raise ValueError(
            "a system unit runs as a dedicated user, not root: create one (useradd --system "
            "--user-group --home-dir /var/lib/loragate loragate) and name it"
        )

    unit = ["[Unit]", "Description=loragate: LoRA gateway in front of a supervised vLLM engine"]
    if not user_mode:
        unit += ["After=network-online.target", "Wants=network-online.target"]

    if working_directory is None:
        workdir = f"%S/{SERVICE_DIRECTORY}"  # %S: /var/lib, or ~/.local/state for --user
    else:
        workdir = _single_line("WorkingDirectory", str(working_directory.absolute()))
    service = [
        "[Service]",
        "Type=notify",
        # Only the gateway itself may report readiness; the engine inherits NOTIFY_SOCKET.
        "NotifyAccess=main",
        "ExecStart=" + " ".join(quote_exec_arg(arg) for arg in exec_start),
    ]
    if environment_file is not None:
        path = _single_line("EnvironmentFile", str(environment_file.absolute()))
        # The leading '-' lets the unit start when the file does not exist (yet).
        service.append(f"EnvironmentFile=-{path}")
    if user is not None:
        name = _single_line("User", user)
        service += [f"User={name}", f"Group={name}"]
    service += [
        f"StateDirectory={SERVICE_DIRECTORY}",
        f"CacheDirectory={SERVICE_DIRECTORY}",
        f"WorkingDirectory={workdir}",
    ]
    if not user_mode:
        # A home the sandbox lets it write (Triton's and vLLM's own caches live under it), and
        # Hugging Face downloads (base models, hf:// adapters) in the cache directory.
        service += [
            f"Environment=HOME=%S/{SERVICE_DIRECTORY}",
            f"Environment=HF_HOME=%C/{SERVICE_DIRECTORY}/huggingface",
        ]
    service += [
        "Restart=on-failure",
        # Exit code 2 is a usage error (no model, a bad setting): restarting would repeat it.
        "RestartPreventExitStatus=2",
        "RestartSec=5",
        # A start that downloads, dequantizes or boots sends EXTEND_TIMEOUT_USEC= (30 s from
        # now) every 10 s (sd_notify.extend_start_while): this bounds only a silent start.
        "TimeoutStartSec=300",
        "TimeoutStopSec=60",
        "WatchdogSec=60",
        "KillMode=mixed",
        "KillSignal=SIGTERM",
        "LimitNOFILE=65536",
    ]
    if user_mode:
        service.append("NoNewPrivileges=yes")
    else:
        in_home = any(executable.is_relative_to(tree) for tree in _HOME_TREES)
        # An install under a home directory must stay readable; elsewhere homes are hidden.
        service += ["ProtectHome=" + ("read-only" if in_home else "yes"), *_SANDBOX]
    install = ["[Install]", "WantedBy=" + ("default.target" if user_mode else "multi-user.target")]
    return "\n".join([*unit, "", *service, "", *install]) + "\n"


def default_exec_start() -> list[str]:
    """``gateway serve`` for the Python running now: its ``gateway`` script, else ``-m``."""
    # Not resolved: a virtualenv's python is a symlink, and resolving it would leave the venv.
    script = Path(sys.executable).parent / "gateway"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script.absolute()), "serve"]
    return [sys.executable, "-m", "loragate.cli", "serve"]
