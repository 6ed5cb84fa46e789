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
