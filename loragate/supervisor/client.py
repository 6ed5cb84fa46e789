"""The engine's admin calls (LoRA load/unload, model list), for the adapter manager.

Only the gateway holds the engine's per-boot key, so only it can reach these endpoints. They
go over the engine's Unix socket with ``loragate.http.oneshot`` (one exchange per call: they
are rare), which never reads ``HTTP_PROXY`` from the environment: a proxy must never receive the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loragate.engine_states import listed_max_model_len
from loragate.http import oneshot
from loragate.supervisor.engine import EngineSupervisor, EngineUnavailable


class EngineRefused(Exception):
    """The engine answered an admin call with an error; ``detail`` is its message."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"the engine refused the adapter (HTTP {status}): {detail}")
        self.status = status
        self.detail = detail


class EngineClient:
    def __init__(self, supervisor: EngineSupervisor, timeout: float = 300.0) -> None:
        self._supervisor = supervisor
        self._timeout = timeout
        # The context length the engine's model list gave, at its last boot (None: not yet).
        self.max_model_len: int | None = None

    async def _send(
        self, method: str, path: str, body: dict[str, str] | None = None
    ) -> oneshot.PlainResponse:
        endpoint = self._supervisor.endpoint
        if endpoint is None:
            raise EngineUnavailable("the engine has not started yet")
        try:
            return await oneshot.request(
                method,
                f"{endpoint.base_url}{path}",
                timeout=self._timeout,
                headers=endpoint.headers,
                json=body,
                uds=endpoint.uds,
            )
        except oneshot.PlainHTTPError as exc:
            raise EngineUnavailable(f"the engine did not answer {path}: {exc}") from exc

    async def load_adapter(self, engine_id: str, path: Path) -> None:
        response = await self._send(
            "POST", "/v1/load_lora_adapter", {"lora_name": engine_id, "lora_path": str(path)}
        )
        if response.status != 200:
            raise EngineRefused(response.status, _detail(response))

    async def unload_adapter(self, engine_id: str) -> None:
        response = await self._send("POST", "/v1/unload_lora_adapter", {"lora_name": engine_id})
        if response.status not in (200, 404):
            raise EngineRefused(response.status, _detail(response))

    async def served_ids(self) -> set[str]:
        response = await self._send("GET", "/v1/models")
        if response.status != 200:
            raise EngineUnavailable(
                f"the engine's model list answered HTTP {response.status}: {_detail(response)}"
            )
        listing = _json(response)
        self.max_model_len = listed_max_model_len(listing)
        items = listing.get("data", []) if isinstance(listing, dict) else []
        return {item["id"] for item in items if isinstance(item, dict) and "id" in item}

    async def sleep(self) -> None:
        """vLLM's sleep mode, level 1: weights to host memory, KV cache dropped; the engine
        process stays (it must run with ``--enable-sleep-mode`` and VLLM_SERVER_DEV_MODE=1)."""
        response = await self._send("POST", "/sleep?level=1")
        if response.status != 200:
            raise EngineUnavailable(f"the engine did not go to sleep: {_detail(response)}")

    async def wake_up(self) -> None:
        response = await self._send("POST", "/wake_up")
        if response.status != 200:
            raise EngineUnavailable(f"the engine did not wake up: {_detail(response)}")

    async def aclose(self) -> None:
        """Nothing to close: each call has its own connection (kept for the backend's stop)."""


def _json(response: oneshot.PlainResponse) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _detail(response: oneshot.PlainResponse) -> str:
    body = _json(response)
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return response.text.strip()[:2000]
