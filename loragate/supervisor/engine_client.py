"""The engine's admin calls (LoRA load/unload, model list), for the adapter manager.

Only the gateway holds the engine's per-boot key, so only it can reach these endpoints. They
go over the engine's Unix socket, with ``trust_env=False``: an ``HTTP_PROXY`` in the
environment must never receive the engine's key.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from loragate.supervisor.engine import EngineEndpoint, EngineSupervisor, EngineUnavailable


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
        self._http: httpx.AsyncClient | None = None
        self._uds: str | None = None

    async def _client(self, endpoint: EngineEndpoint) -> httpx.AsyncClient:
        # One client per socket path: the path is fixed for a supervisor's life, but a client
        # built for another one must not be reused.
        if self._http is None or self._uds != endpoint.uds:
            if self._http is not None:
                await self._http.aclose()
            transport = httpx.AsyncHTTPTransport(uds=endpoint.uds)
            self._http = httpx.AsyncClient(
                transport=transport, timeout=self._timeout, trust_env=False
            )
            self._uds = endpoint.uds
        return self._http

    async def _send(
        self, method: str, path: str, body: dict[str, str] | None = None
    ) -> httpx.Response:
        endpoint = self._supervisor.endpoint
        if endpoint is None:
            raise EngineUnavailable("the engine has not started yet")
        http = await self._client(endpoint)
        try:
            return await http.request(
                method, f"{endpoint.base_url}{path}", headers=endpoint.headers, json=body
            )
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"the engine did not answer {path}: {exc!r}") from exc

    async def load_adapter(self, engine_id: str, path: Path) -> None:
        response = await self._send(
            "POST", "/v1/load_lora_adapter", {"lora_name": engine_id, "lora_path": str(path)}
        )
        if response.status_code != 200:
            raise EngineRefused(response.status_code, _detail(response))

    async def unload_adapter(self, engine_id: str) -> None:
        response = await self._send("POST", "/v1/unload_lora_adapter", {"lora_name": engine_id})
        if response.status_code not in (200, 404):
            raise EngineRefused(response.status_code, _detail(response))

    async def served_ids(self) -> set[str]:
        response = await self._send("GET", "/v1/models")
        response.raise_for_status()
        return {item["id"] for item in response.json().get("data", [])}

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:2000]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return response.text.strip()[:2000]
