"""Admin routes: adapters (add, swap, remove, roll back) and the engine (state, restart)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field, ValidationError
from starlette.responses import JSONResponse, Response

from loragate.adapters.manager import AdapterError, AdapterManager
from loragate.gateway.backends.supervised import SupervisedEngineBackend
from loragate.gateway.errors import OpenAIError
from loragate.gateway.openapi_schemas import LOAD_LORA_ADAPTER, UNLOAD_LORA_ADAPTER, json_body
from loragate.gateway.requests.body import read_json_object
from loragate.gateway.runtime import Gateway
from loragate.logs import loggable_in
from loragate.supervisor.process import tree_rss_bytes


def _admit_admin(request: Request) -> None:
    # A router dependency: no admin route can forget the check. It runs before the handler
    # and no handler declares a body, so nothing of a body is read before it passed.
    gateway: Gateway = request.app.state.gateway
    gateway.admit_admin(request, request.client.host if request.client else None)


router = APIRouter(dependencies=[Depends(_admit_admin)])

# Admin bodies are a name and a source: a mebibyte is plenty, and bounds what a client with
# the key can make the gateway buffer.
ADMIN_MAX_BODY_BYTES = 1 << 20


class AdapterRequest(BaseModel):
    source: str = Field(
        description="Local dir or archive, hf://ORG/REPO[@REV][/SUBDIR], https://…, tinker://…"
    )
    revision: str | None = None
    follow: bool = False


def _engine_backend(request: Request) -> SupervisedEngineBackend:
    gateway: Gateway = request.app.state.gateway
    backend = gateway.backend
    if not isinstance(backend, SupervisedEngineBackend):
        raise OpenAIError(
            404, "This gateway's backend has no managed engine or adapters.", code="not_supported"
        )
    return backend


def _manager(request: Request) -> AdapterManager:
    return _engine_backend(request).require_manager()


def _changeable_manager(request: Request) -> AdapterManager:
    """The manager, for a change to this gateway's adapters: refused when a fleet manifest
    owns them (a change here would diverge from the other replicas)."""
    backend = _engine_backend(request)
    if backend.fleet is not None:
        raise OpenAIError(
            409,
            f"this gateway serves the adapters of the manifest {backend.fleet.report()['source']}"
            "; change the manifest instead (every replica following it converges on the change)",
            code="managed_by_manifest",
        )
    return backend.require_manager()


def _fail(exc: AdapterError) -> OpenAIError:
    return OpenAIError(exc.status, str(exc), code=exc.code)


@router.get("/admin/adapters")
async def list_adapters(request: Request) -> dict[str, Any]:
    backend = _engine_backend(request)
    manager = backend.require_manager()
    return {
        "object": "list",
        "base_model": manager.base_name,
        "data": manager.list(),
        # Adds running now or finished lately (a failed add of a new name shows only here).
        "progress": [record.as_dict() for record in manager.progress.all()],
        "adapters_manifest": backend.fleet.report() if backend.fleet is not None else None,
    }


@router.get("/admin/adapters/{name}")
async def get_adapter(name: str, request: Request) -> dict[str, Any]:
    """One adapter, with the progress of its latest add (stage, bytes, percent) while it runs."""
    manager = _manager(request)
    record = manager.progress.get(name)
    try:
        body = manager.describe(name)
    except KeyError:
        if record is None:
            raise OpenAIError(404, f"no adapter named {name!r}", code="adapter_not_found") from None
        body = {"name": name, "state": record.stage if record.finished else "adding"}
    return {**body, "progress": record.as_dict() if record else None}


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
    manager = _changeable_manager(request)
    body = await _adapter_request(request)
    try:
        return await manager.put(name, body.source, body.revision, body.follow)
    except AdapterError as exc:
        raise _fail(exc) from None


@router.delete("/admin/adapters/{name}")
async def delete_adapter(name: str, request: Request) -> dict[str, Any]:
    manager = _changeable_manager(request)
    try:
        await manager.remove(name)
    except AdapterError as exc:
        raise _fail(exc) from None
    return {"name": name, "deleted": True}


@router.post("/admin/adapters/{name}/rollback")
async def rollback_adapter(name: str, request: Request) -> dict[str, Any]:
    manager = _changeable_manager(request)
    try:
        return await manager.rollback(name)
    except AdapterError as exc:
        raise _fail(exc) from None


@router.post("/v1/load_lora_adapter", openapi_extra=json_body(LOAD_LORA_ADAPTER))
async def load_lora_adapter(request: Request) -> Response:
    """vLLM-compatible: goes through the manager (store, validation, versioned swap)."""
    manager = _changeable_manager(request)
    body = await read_json_object(request, ADMIN_MAX_BODY_BYTES, limit_name="admin bodies")
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not isinstance(path, str):
        raise OpenAIError(
            400, "send {'lora_name': NAME, 'lora_path': SOURCE}", code="invalid_request"
        )
    try:
        await manager.put(name, path)
    except AdapterError as exc:
        raise _fail(exc) from None
    return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")


@router.post("/v1/unload_lora_adapter", openapi_extra=json_body(UNLOAD_LORA_ADAPTER))
async def unload_lora_adapter(request: Request) -> Response:
    manager = _changeable_manager(request)
    body = await read_json_object(request, ADMIN_MAX_BODY_BYTES, limit_name="admin bodies")
    name = body.get("lora_name")
    if not isinstance(name, str):
        raise OpenAIError(400, "send {'lora_name': NAME}", code="invalid_request")
    try:
        await manager.remove(name)
    except AdapterError as exc:
        raise _fail(exc) from None
    return Response(
        f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain"
    )


@router.get("/admin/engine")
async def engine_info(request: Request) -> dict[str, Any]:
    report = _engine_backend(request).engine_report()
    launcher = report.get("launcher_pid")
    rss = await asyncio.to_thread(tree_rss_bytes, launcher) if launcher else None
    # Its log tail is shown as /admin/logs shows the engine's lines (the status page has both).
    return {**loggable_in(report), "rss_bytes": rss}


@router.post("/admin/engine/restart")
async def engine_restart(request: Request) -> JSONResponse:
    engine = await _engine_backend(request).restart_engine()
    return JSONResponse({"restarting": True, "state": str(engine.state)}, status_code=202)
