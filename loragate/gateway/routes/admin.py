"""Admin routes: adapters (add, swap, remove, roll back), the engine (state, restart) and a
catalog's base models (list, load, unload).

Thin handlers over the backend's admin interface (``backends.base.AdminBackend``): it owns the
checks and the changes, and its refusals are the answers; a change is admitted before its
body is read, so a refused one buffers nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field, ValidationError
from starlette.responses import JSONResponse, Response

from loragate.gateway.backends.base import AdminBackend, admin_of, catalog_of
from loragate.gateway.errors import OpenAIError
from loragate.gateway.openapi_schemas import LOAD_LORA_ADAPTER, UNLOAD_LORA_ADAPTER, json_body
from loragate.gateway.requests.body import read_json_object
from loragate.gateway.runtime import Gateway
from loragate.logs import loggable_in


def _admit_admin(request: Request) -> None:
    # A router dependency: no admin route can forget the check. It runs before the handler
    # and no handler declares a body, so nothing of a body is read before it passed.
    gateway: Gateway = request.app.state.gateway
    gateway.admit_admin(request, request.client.host if request.client else None)


router = APIRouter(dependencies=[Depends(_admit_admin)])

# Admin bodies are a name, a source and a preset: a mebibyte is plenty, and bounds what a
# client with the key can make the gateway buffer.
ADMIN_MAX_BODY_BYTES = 1 << 20


class AdapterRequest(BaseModel):
    source: str = Field(
        description="Local dir or archive, hf://ORG/REPO[@REV][/SUBDIR], https://…, tinker://…"
    )
    revision: str | None = None
    follow: bool = False
    preset: dict[str, Any] | None = Field(
        default=None,
        description="The version's preset (docs/adapters.md): system_prompt, system_prompt_mode "
        '("default" | "always"), defaults, clamps, stop, response_format, user_prompt, '
        "chat_template, renderer. {} for none; left out: the source's loragate.json, if any.",
    )


def _admin(request: Request) -> AdminBackend:
    gateway: Gateway = request.app.state.gateway
    return admin_of(gateway.backend)


def _local_roots(request: Request) -> list[Path] | None:
    """Where a local source this admin client names may lie: under ``adapter_source_roots``;
    anywhere (None) when the only key is the per-start token, which only the gateway's own
    user (the CLI on its machine) can read, and who reads those files already."""
    gateway: Gateway = request.app.state.gateway
    if gateway.admin_token is not None:
        return None
    return gateway.settings.source_roots()


@router.get("/admin/adapters")
async def list_adapters(request: Request) -> dict[str, Any]:
    return {"object": "list", **_admin(request).adapters_report()}


@router.get("/admin/adapters/{name}")
async def get_adapter(name: str, request: Request) -> dict[str, Any]:
    """One adapter, with the progress of its latest add (stage, bytes, percent) while it runs."""
    return _admin(request).adapter_report(name)


async def _adapter_request(request: Request) -> AdapterRequest:
    # Read here, not as a FastAPI body parameter: FastAPI reads and parses those before any
    # dependency runs, so an unauthenticated client could make it buffer any amount.
    raw = await read_json_object(request, ADMIN_MAX_BODY_BYTES, limit_name="admin bodies")
    try:
        return AdapterRequest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise OpenAIError(
            400, f"{where}: {first['msg']}", param=where or None, code="invalid_request"
        ) from None


@router.put("/admin/adapters/{name}", openapi_extra=json_body(AdapterRequest.model_json_schema()))
async def put_adapter(name: str, request: Request) -> dict[str, Any]:
    backend = _admin(request)
    backend.admit_adapter_change()
    body = await _adapter_request(request)
    roots = _local_roots(request)
    return await backend.put_adapter(
        name, body.source, body.revision, body.follow, body.preset, local_roots=roots
    )


@router.delete("/admin/adapters/{name}")
async def delete_adapter(name: str, request: Request) -> dict[str, Any]:
    await _admin(request).remove_adapter(name)
    return {"name": name, "deleted": True}


@router.post("/admin/adapters/{name}/rollback")
async def rollback_adapter(name: str, request: Request) -> dict[str, Any]:
    return await _admin(request).rollback_adapter(name)


@router.post("/v1/load_lora_adapter", openapi_extra=json_body(LOAD_LORA_ADAPTER))
async def load_lora_adapter(request: Request) -> Response:
    """vLLM-compatible: goes through the manager (store, validation, versioned swap)."""
    backend = _admin(request)
    backend.admit_adapter_change()
    body = await read_json_object(request, ADMIN_MAX_BODY_BYTES, limit_name="admin bodies")
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not isinstance(path, str):
        raise OpenAIError(
            400, "send {'lora_name': NAME, 'lora_path': SOURCE}", code="invalid_request"
        )
    await backend.put_adapter(name, path, local_roots=_local_roots(request))
    return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")


@router.post("/v1/unload_lora_adapter", openapi_extra=json_body(UNLOAD_LORA_ADAPTER))
async def unload_lora_adapter(request: Request) -> Response:
    backend = _admin(request)
    backend.admit_adapter_change()
    body = await read_json_object(request, ADMIN_MAX_BODY_BYTES, limit_name="admin bodies")
    name = body.get("lora_name")
    if not isinstance(name, str):
        raise OpenAIError(400, "send {'lora_name': NAME}", code="invalid_request")
    await backend.remove_adapter(name)
    return Response(
        f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain"
    )


@router.get("/admin/engine")
async def engine_info(request: Request) -> dict[str, Any]:
    # Its log tail is shown as /admin/logs shows the engine's lines (the status page has both).
    return loggable_in(await _admin(request).engine_report())


@router.post("/admin/engine/restart")
async def engine_restart(request: Request) -> JSONResponse:
    engine = await _admin(request).restart_engine()
    return JSONResponse({"restarting": True, "state": str(engine.state)}, status_code=202)


@router.get("/admin/models")
async def list_base_models(request: Request) -> dict[str, Any]:
    """A catalog's base models: residency, engine state, memory, last use, adapters; swaps."""
    gateway: Gateway = request.app.state.gateway
    return {"object": "list", **catalog_of(gateway.backend).catalog_report()}


@router.post("/admin/models/{model_id}/load")
async def load_base_model(model_id: str, request: Request) -> dict[str, Any]:
    gateway: Gateway = request.app.state.gateway
    return await catalog_of(gateway.backend).load_by_hand(model_id)


@router.post("/admin/models/{model_id}/unload")
async def unload_base_model(model_id: str, request: Request) -> dict[str, Any]:
    gateway: Gateway = request.app.state.gateway
    return await catalog_of(gateway.backend).unload_by_hand(model_id)
