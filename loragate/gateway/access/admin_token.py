"""The admin key of a gateway started without ``--admin-key``: a fresh token each start.

Admin routes never answer without a key (unless ``open_admin`` asks for it). Without a
configured key, the gateway makes a random token when it starts and writes it to
``CACHE_DIR/admin-token``, readable by its own user only; the ``gateway`` CLI on the same
machine reads it, so ``gateway adapters ...`` and ``gateway status`` need no flag. A web page,
another user or another machine has no way to it. The file is removed when the gateway stops.
On a terminal, the start prints the status page's address with the token (``status_page_url``),
to that terminal only: never to a log, whose readers (journald, ``kubectl logs``, ``/admin/logs``)
are not all the cache dir's.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

TOKEN_FILE = "admin-token"


def new_admin_token() -> str:
    return secrets.token_urlsafe(32)


def status_page_url(host: str, port: int, token: str) -> str:
    """The status page's address holding ``token`` in its fragment (as Jupyter's ``?token=``
    start line): the page keeps it in the tab's sessionStorage and drops it from the address.
    A fragment never reaches a server, so no proxy or access log records it."""
    where = f"[{host}]" if ":" in host else host
    return f"http://{where}:{port}/ui#token={token}"


def token_path(cache_dir: Path) -> Path:
    return cache_dir.expanduser() / TOKEN_FILE


def publish_admin_token(cache_dir: Path, token: str) -> Path:
    """Write ``token`` to the cache dir's token file, mode 0600, whole or not at all."""
    path = token_path(cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{TOKEN_FILE}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    # O_EXCL|O_NOFOLLOW: a file or link planted under the temporary name is never written
    # through; os.replace swaps in the new file even where a link stood at the final name.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    descriptor = os.open(temporary, flags, 0o600)
    try:
        os.write(descriptor, token.encode() + b"\n")
    finally:
        os.close(descriptor)
    os.replace(temporary, path)
    return path


def withdraw_admin_token(cache_dir: Path, token: str) -> None:
    """Remove the token file if it still holds ``token`` (a later gateway's stays)."""
    if read_admin_token(cache_dir) == token:
        with contextlib.suppress(FileNotFoundError):
            token_path(cache_dir).unlink()


def read_admin_token(cache_dir: Path) -> str | None:
    try:
        token = token_path(cache_dir).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return token or None
