"""The engine's Unix socket, in a directory only this user can enter.

Why not a TCP port on loopback: vLLM's key middleware guards only ``/v1``, ``/v2``,
``/inference`` and ``/cohere``, so ``/invocations`` and the like answer any local user; and a
port picked by the gateway is bound later by the engine, so a process that takes it first
receives the per-boot key and every prompt. A socket file in a 0700 directory has neither
problem: only our user can connect, and only our user can create the file, so nobody can be
listening there before the engine. The engine binds it with ``--uds PATH``.

The directory is ``<cache dir>/engine-socket``, unless that path is too long for a socket
address (108 bytes on Linux); then a fresh ``mkdtemp`` directory (0700, unguessable name)
under ``$XDG_RUNTIME_DIR`` or the temporary directory, removed on stop.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from pathlib import Path

SOCKET_NAME = "engine.sock"
# sun_path holds 108 bytes on Linux, the final NUL included.
MAX_SOCKET_PATH = 107


class EngineSocketError(RuntimeError):
    """The socket's directory is not private to this user, or the socket path is taken by
    something that must not be removed."""


def ensure_private_dir(directory: Path) -> None:
    """Create ``directory`` 0700, or check that the one there is ours and make it 0700.

    A symlink, another user's directory or anything that is not a directory is refused:
    the engine's key and every prompt pass through the socket inside.
    """
    directory.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise EngineSocketError(
            f"{directory} is not a directory (a symlink or file is there); remove it, and "
            "loragate creates a private directory for the engine's socket"
        )
    if info.st_uid != os.geteuid():
        raise EngineSocketError(
            f"{directory} belongs to uid {info.st_uid}, not to this user; remove it, or use "
            "a cache dir that only this user can write"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        # Ours but open to others: close it before anything inside is trusted.
        os.chmod(directory, 0o700)


def remove_stale_socket(path: Path) -> None:
    """Remove whatever file is at ``path`` (a socket left by an engine that died, or anything
    else), so that the engine binds a fresh one. A directory there is an error."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        raise EngineSocketError(f"{path} is a directory; remove it so the engine can bind there")
    path.unlink(missing_ok=True)


class EngineSocket:
    """Where one supervisor's engine listens: ``path_for_boot()`` before each spawn."""

    def __init__(self, cache_dir: Path) -> None:
        self._preferred = cache_dir.absolute() / "engine-socket"
        self._directory: Path | None = None
        self._temporary = False

    @property
    def path(self) -> Path | None:
        return self._directory / SOCKET_NAME if self._directory is not None else None

    def path_for_boot(self) -> Path:
        """The socket path for the next boot: private directory checked, stale file gone."""
        if self._directory is None:
            if len(os.fsencode(self._preferred / SOCKET_NAME)) <= MAX_SOCKET_PATH:
                self._directory = self._preferred
            else:
                base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
                self._directory = Path(tempfile.mkdtemp(prefix="loragate-engine-", dir=base))
                self._temporary = True
        ensure_private_dir(self._directory)
        path = self._directory / SOCKET_NAME
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise EngineSocketError(
                f"the engine socket path {path} is longer than {MAX_SOCKET_PATH} bytes; "
                "set XDG_RUNTIME_DIR or TMPDIR to a shorter directory"
            )
        remove_stale_socket(path)
        return path

    def remove(self) -> None:
        """Remove the socket file (and a temporary directory) once the engine has stopped."""
        if self._directory is None:
            return
        with contextlib.suppress(OSError, EngineSocketError):
            remove_stale_socket(self._directory / SOCKET_NAME)
        if self._temporary:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory, self._temporary = None, False
