"""The error every adapter operation raises, with the HTTP status a client should see."""

from __future__ import annotations

from loragate.adapters.downloads import redact_urls


class AdapterError(Exception):
    """An adapter operation failed; ``status`` is the HTTP status a client should see."""

    def __init__(self, message: str, status: int = 400, code: str = "adapter_error") -> None:
        # Shown to clients, in /health and in logs: never a source's credentials.
        super().__init__(redact_urls(message))
        self.status = status
        self.code = code
