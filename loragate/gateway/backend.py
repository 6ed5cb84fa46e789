"""What the gateway's routes need from whatever answers requests behind them."""

from __future__ import annotations

from typing import Any, Protocol

from starlette.responses import Response


class GatewayBackend(Protocol):
    """The routes' view of a backend: the supervised engine, an upstream URL, or a custom one."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def model_ids(self) -> list[str]:
        """Public model ids, base model first."""
        ...

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(ready, body) for GET /health."""
        ...

    async def forward(
        self, path: str, payload: dict[str, Any], public_model: str, stream: bool, request_id: str
    ) -> Response:
        """Answer an OpenAI request whose ``model`` is ``public_model``."""
        ...
