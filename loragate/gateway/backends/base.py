"""What the gateway's routes need from whatever answers requests behind them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import orjson
from starlette.responses import Response

from loragate.adapters.stats import AdapterStats
from loragate.engine_states import EngineSnapshot
from loragate.gateway.errors import OpenAIError
from loragate.gateway.observe.metrics import ask_for_usage


class GatewayBackend(Protocol):
    """The routes' view of a backend: the managed engines, an upstream URL, or a custom one."""

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


@dataclass(frozen=True)
class EngineCall:
    """A request for one of the engine's allow-listed routes (``engine_allow_list``), any shape.

    ``body`` builds the bytes to send given the engine's id for ``public_model`` (None when
    the request names no model), so the backend can pick the adapter version at send time.
    ``payload``: the JSON body of a generation request (``json_post``), for a backend that
    shapes it by the version it leased (its preset) before sending it.
    """

    method: str
    path: str  # with the query string, as the engine should see it
    body: Callable[[str | None], bytes]
    content_type: str | None
    public_model: str | None
    stream: bool
    request_id: str
    payload: dict[str, Any] | None = None


def json_post(
    path: str, payload: dict[str, Any], public_model: str, stream: bool, request_id: str
) -> EngineCall:
    """``forward``'s request as an ``EngineCall``: ``payload`` as JSON, its model set to the id
    the backend picks at send time. A stream is asked for its usage chunk (``ask_for_usage``:
    its tokens are counted, the chunk dropped unless the client asked for it)."""
    ask_for_usage(path, payload)

    def body(model_id: str | None) -> bytes:
        payload["model"] = model_id
        return orjson.dumps(payload)

    return EngineCall(
        "POST", path, body, "application/json", public_model, stream, request_id, payload
    )


class RelayingBackend(GatewayBackend, Protocol):
    """A backend that can also send the engine's other allow-listed routes (GET, uploads)."""

    async def relay(self, call: EngineCall) -> Response: ...


@runtime_checkable
class ObservableBackend(GatewayBackend, Protocol):
    """A backend that reports on the engines and adapters it runs (the managed one), in
    frozen values: the metrics, status and admin routes never read its parts."""

    def engine_snapshot(self) -> EngineSnapshot: ...

    async def adapter_stats(self) -> AdapterStats | None:
        """None until the adapters are set up."""
        ...

    async def engine_metrics(self) -> bytes | None:
        """The engine's own /metrics text with public model names, or None."""
        ...


@runtime_checkable
class AdminBackend(Protocol):
    """What the admin routes ask of a backend that manages its engine and adapters (the
    managed one). Every change goes through these methods, and they own its checks (the
    gateway still starting: 503; a fleet manifest owning the adapters: 409) and answer a
    refusal as the ``OpenAIError`` a client sees, so the routes read nothing of a manager,
    a fleet or a supervisor. A backend without it (upstream, custom) gets ``admin_of``'s 404.
    """

    def adapters_report(self) -> dict[str, Any]:
        """``GET /admin/adapters``: ``base_model``, ``data`` (the adapters), ``progress`` (the
        adds running or finished lately) and ``adapters_manifest`` (the fleet's, or None)."""
        ...

    def adapter_report(self, name: str) -> dict[str, Any]:
        """One adapter, with the ``progress`` of its latest add; 404 when neither exists."""
        ...

    def admit_adapter_change(self) -> None:
        """Raise the refusal a change to the adapters would get now, else nothing: the routes
        ask before they read a body, so a refused change buffers none."""
        ...

    async def put_adapter(
        self,
        name: str,
        source: str,
        revision: str | None = None,
        follow: bool = False,
        preset: dict[str, Any] | None = None,
        *,
        local_roots: Sequence[Path] | None,
    ) -> dict[str, Any]:
        """Add ``name`` from ``source``, or swap it to a new version; the adapter's record.
        ``preset``: the version's preset as the client sent it (``{}``: none; None: the
        source's own ``loragate.json``); a bad one is the 400 and changes nothing.
        ``local_roots``: where a local ``source`` may lie (a client's, under
        ``adapter_source_roots``: elsewhere a 403 that tells nothing of the path); None for a
        source the operator named, or a caller who holds the gateway user's files already."""
        ...

    async def remove_adapter(self, name: str) -> None: ...

    async def rollback_adapter(self, name: str) -> dict[str, Any]:
        """Serve ``name``'s previous version again; the adapter's record."""
        ...

    async def engine_report(self) -> dict[str, Any]:
        """``GET /admin/engine``: the supervision (its log tail included), what loragate chose
        for the engine, and the memory its processes hold (``rss_bytes``)."""
        ...

    async def restart_engine(self) -> EngineSnapshot:
        """Ask for a restart; the engine's snapshot once it was asked."""
        ...


@runtime_checkable
class ModelsAdmin(Protocol):
    """What ``/admin/models`` (``gateway models list|load|unload``) asks of a backend that
    runs base models: a catalog, or one model (a catalog of one)."""

    def catalog_report(self) -> dict[str, Any]:
        """Every model with its residency, state, memory, last use and adapters; the swaps."""
        ...

    async def load_by_hand(self, model_id: str) -> dict[str, Any]: ...

    async def unload_by_hand(self, model_id: str) -> dict[str, Any]: ...


@runtime_checkable
class CatalogAdmin(ModelsAdmin, Protocol):
    """A backend serving several base models, each its own engine."""

    def engine_snapshots(self) -> dict[str, EngineSnapshot]:
        """Every model's engine, by model id."""
        ...


def catalog_of(backend: GatewayBackend) -> ModelsAdmin:
    """``backend``'s base models, or the 404 a gateway without an engine of its own (an
    upstream URL, a custom backend) answers."""
    if not isinstance(backend, ModelsAdmin):
        raise OpenAIError(
            404,
            "This gateway runs no base model of its own (an upstream URL or a custom "
            "backend): nothing loads or unloads here.",
            code="not_supported",
        )
    return backend


def admin_of(backend: GatewayBackend) -> AdminBackend:
    """``backend``'s admin interface, or the 404 every admin route gives a backend that has
    none (an upstream URL, a custom backend: no engine or adapters of the gateway's own)."""
    if not isinstance(backend, AdminBackend):
        raise OpenAIError(
            404, "This gateway's backend has no managed engine or adapters.", code="not_supported"
        )
    return backend


def engine_snapshot_of(backend: GatewayBackend) -> EngineSnapshot | None:
    """The engine's snapshot when ``backend`` runs one (None for upstream and custom ones)."""
    return backend.engine_snapshot() if isinstance(backend, RunsEngine) else None


async def adapter_stats_of(backend: GatewayBackend) -> AdapterStats | None:
    return await backend.adapter_stats() if isinstance(backend, ObservableBackend) else None


async def engine_metrics_of(backend: GatewayBackend) -> bytes | None:
    return await backend.engine_metrics() if isinstance(backend, ObservableBackend) else None


# ----- what some backends also do: one method each, asked with isinstance -------------------
# The routes call nothing a backend may lack without asking one of these first (no getattr or
# hasattr on a backend: tests/unit/test_import_graph.py reads the routes for it).


@runtime_checkable
class RunsEngine(Protocol):
    """A backend that runs engines of its own (the managed one)."""

    def engine_snapshot(self) -> EngineSnapshot: ...


@runtime_checkable
class ReportsStart(Protocol):
    """A backend that prepares what it serves as it starts (downloads the base model,
    dequantizes a GGUF, boots the engine), with a progress record while it does."""

    def start_report(self) -> dict[str, Any] | None:
        """Stage, bytes, percent, rate and description; None when nothing is under way."""
        ...


@runtime_checkable
class ListsModels(Protocol):
    """A backend that makes its own ``/v1/models`` entries (a catalog: each adapter's parent,
    each base's residency; a Vi backend)."""

    def model_entries(self) -> list[dict[str, Any]]:
        """One entry per public model, each with its ``id`` and ``parent`` (None: a base)."""
        ...


@runtime_checkable
class ResolvesModels(Protocol):
    """A backend that can serve a model it has not registered yet, found in a place the
    operator configured (a catalog model's ``adapter_dir``)."""

    def resolves(self, name: str) -> bool: ...


@runtime_checkable
class KnowsContextLength(Protocol):
    """A backend that knows its engine's ``max_model_len`` (clients size their context by it)."""

    def max_model_len(self) -> int | None:
        """None until the engine has said."""
        ...


@runtime_checkable
class ServesPresets(Protocol):
    """A backend whose adapter versions carry presets (``adapters.preset``)."""

    def model_preset(self, name: str) -> dict[str, Any] | None:
        """The preset of the version serving ``name`` now; None when it has none."""
        ...


@runtime_checkable
class RelaysEngineCalls(Protocol):
    """A backend that sends the engine's other allow-listed routes (``EngineCall``: GETs,
    uploads) besides ``forward``'s JSON POSTs."""

    async def relay(self, call: EngineCall) -> Response: ...
