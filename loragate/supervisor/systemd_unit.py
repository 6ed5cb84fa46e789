"""A systemd unit for this install: ``Type=notify`` with a watchdog, so systemd knows when the
gateway really serves and restarts it when it wedges.

``KillMode=mixed`` sends SIGTERM to the gateway alone, which stops the engine tree itself
(gracefully, in order); only what is left after ``TimeoutStopSec`` gets SIGKILL from systemd.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

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


def render_unit(
    *,
    exec_start: list[str],
    working_directory: Path,
    user: str | None,
    environment_file: Path | None,
    user_mode: bool,
) -> str:
    """The text of a ``loragate.service`` unit.

    ``user_mode`` renders a unit for ``systemctl --user``: no ``User=``, no dependency on the
    system's ``network-online.target`` (a user manager cannot order against it), and
    ``WantedBy=default.target``. Raises ValueError for settings systemd would reject.
    """
    if not exec_start:
        raise ValueError("exec_start is empty: give the command that runs `gateway serve`")
    if not Path(exec_start[0]).is_absolute():
        raise ValueError(f"ExecStart needs an absolute executable path, not {exec_start[0]!r}")
    if user_mode and user is not None:
        raise ValueError("User= has no meaning in a user unit: drop the user or the user mode")

    unit = ["[Unit]", "Description=loragate: LoRA gateway in front of a supervised vLLM engine"]
    if not user_mode:
        unit += ["After=network-online.target", "Wants=network-online.target"]

    service = [
        "[Service]",
        "Type=notify",
        # Only the gateway itself may report readiness; the engine inherits NOTIFY_SOCKET.
        "NotifyAccess=main",
        "ExecStart=" + " ".join(quote_exec_arg(arg) for arg in exec_start),
        "WorkingDirectory=" + _single_line("WorkingDirectory", str(working_directory.absolute())),
    ]
    if environment_file is not None:
        path = _single_line("EnvironmentFile", str(environment_file.absolute()))
        # The leading '-' lets the unit start when the file does not exist (yet).
        service.append(f"EnvironmentFile=-{path}")
    if user is not None:
        service.append("User=" + _single_line("User", user))
    service += [
        "Restart=on-failure",
        "RestartSec=5",
        # The engine's first boot compiles and loads weights; minutes are normal.
        "TimeoutStartSec=900",
        "TimeoutStopSec=60",
        "WatchdogSec=60",
        "KillMode=mixed",
        "KillSignal=SIGTERM",
        "LimitNOFILE=65536",
    ]
    install = ["[Install]", "WantedBy=" + ("default.target" if user_mode else "multi-user.target")]
    return "\n".join([*unit, "", *service, "", *install]) + "\n"


def default_exec_start() -> list[str]:
    """``gateway serve`` for the Python running now: its ``gateway`` script, else ``-m``."""
    # Not resolved: a virtualenv's python is a symlink, and resolving it would leave the venv.
    script = Path(sys.executable).parent / "gateway"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script.absolute()), "serve"]
    return [sys.executable, "-m", "loragate.cli", "serve"]
