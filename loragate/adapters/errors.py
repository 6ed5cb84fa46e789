"""The error every adapter operation raises, with the HTTP status a client should see."""

from __future__ import annotations

import errno

from loragate.logs import redact_urls

# A full disk and a full quota read the same to an operator: free space, or store less.
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


class AdapterError(Exception):
    """An adapter operation failed; ``status`` is the HTTP status a client should see."""

    def __init__(self, message: str, status: int = 400, code: str = "adapter_error") -> None:
        # Shown to clients, in /health and in logs: never a source's credentials.
        super().__init__(redact_urls(message))
        self.status = status
        self.code = code


def disk_error(exc: OSError, doing: str) -> AdapterError:
    """``exc``, raised while ``doing`` (e.g. "storing the adapter from SOURCE"), as the error a
    client sees: 507 "no space left on device" for a full disk or quota, else a 500 naming the
    file and what the system said."""
    where = f" ({exc.filename})" if exc.filename else ""
    if exc.errno in _NO_SPACE:
        return AdapterError(
            f"{doing} failed: no space left on device{where}; free disk space (or lower "
            "store_max_bytes so older versions are evicted) and try again",
            status=507,
            code="insufficient_storage",
        )
    return AdapterError(
        f"{doing} failed: {exc.strerror or exc}{where}", status=500, code="adapter_io_error"
    )
