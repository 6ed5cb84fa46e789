"""The managed backend: the gateway's face of the serving core (``loragate.serving``).

Every gateway that runs its own engines, one model or a catalog, serves through one
``Catalog`` (one model is a catalog of one). This backend is where the HTTP layer meets it:
it sends a request to the model the catalog picks, with the engine and adapter version that
model leases for it, through the gateway's proxy (``gateway.proxy``), sending it again to a
restarted engine while the queue deadline allows; and it answers every refusal of the core
(``serving.errors``) and every adapter operation's failure as the OpenAI-style error a client
sees (``gateway.errors.openai_error_of``). Everything else it asks the catalog as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from starlette.responses import Response

from loragate.adapters.errors import AdapterError
from loragate.adapters.stats import AdapterStats
from loragate.engine_states import EngineSnapshot
from loragate.gateway.backends.base import EngineCall, json_post
from loragate.gateway.errors import openai_error_of
from loragate.gateway.observe import spans
from loragate.gateway.proxy import ProxyClient, ResendBudget, UpstreamUnreachable
from loragate.gateway.requests.presets import parameter_rules, shaped_body
from loragate.serving.catalog import Catalog
from loragate.serving.engine_names import AnyVersionRename, Rename
from loragate.serving.errors import ServingError
from loragate.settings import Settings
from loragate.systemd import ServiceStart


@contextlib.contextmanager
def _refusals_answered() -> Iterator[None]:
    """The core's refusals, and an adapter operation's failure, as a client's error."""
    try:
        yield
    except (ServingError, AdapterError) as exc:
        raise openai_error_of(exc) from None


class ManagedBackend:
    """A gateway's own engines behind the routes: its one model, or its catalog's models."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.catalog = Catalog(settings, preset_rules=parameter_rules)
        self.proxy = ProxyClient(
            silence_limit=settings.upstream_timeout or None,
            max_answer_bytes=settings.max_answer_bytes,
        )

    async def start(self) -> None:
        await self.catalog.start()

    async def stop(self) -> None:
        try:
            await self.catalog.stop()
        finally:
            await self.proxy.aclose()

    # ----- serving ------------------------------------------------------------------------

    async def forward(
        self, path: str, payload: dict[str, Any], public_model: str, stream: bool, request_id: str
    ) -> Response:
        return await self.relay(json_post(path, payload, public_model, stream, request_id))

    async def relay(self, call: EngineCall) -> Response:
        """Send ``call`` to the engine of the model that serves it, leasing the adapter
        version it names; again, to the restarted engine, when the engine died before it
        answered (within the queue deadline: ``ResendBudget``)."""
        deadline = time.monotonic() + self.settings.queue_deadline
        resends = ResendBudget(deadline)
        public_model = call.public_model
        while True:
            try:
                # Again for a resend: a model stopped meanwhile (by an admin) boots again.
                model = await self.catalog.take(public_model, deadline)
            except (ServingError, AdapterError) as exc:
                raise openai_error_of(exc) from None
            try:
                if not model.serves_now:
                    await model.until_engine_serves(deadline)
                if public_model is None:
                    lease = await model.lease(None, deadline)
                    rename: Rename | None = AnyVersionRename(lease.base_engine_id, model.base_name)
                else:
                    with spans.step(spans.LEASE):
                        lease = await model.lease(public_model, deadline)
                    assert lease.engine_id is not None
                    rename = Rename.of(lease.engine_id, public_model)
                try:
                    body = shaped_body(lease.preset, call, lease.engine_id)
                except BaseException:
                    lease.done()  # a refusal of the preset's, or anything else
                    raise
                endpoint = lease.endpoint
                return await self.proxy.relay(
                    call,
                    endpoint.base_url + call.path,
                    body,
                    endpoint.headers,
                    rename=rename,
                    on_done=lease.done,
                    uds=endpoint.uds,
                )
            except UpstreamUnreachable as exc:
                # The engine died just now: wait for the restart and send it again.
                if not resends.allows(exc):
                    raise
            except (ServingError, AdapterError) as exc:
                raise openai_error_of(exc) from None
            finally:
                self.catalog.give_back(model)
            await asyncio.sleep(0.2)

    # ----- which models, and how they are -------------------------------------------------

    def model_ids(self) -> list[str]:
        return self.catalog.model_ids()

    def model_entries(self) -> list[dict[str, Any]]:
        return self.catalog.model_entries()

    def model_preset(self, name: str) -> dict[str, Any] | None:
        return self.catalog.model_preset(name)

    def resolves(self, name: str) -> bool:
        return self.catalog.resolves(name)

    def max_model_len(self) -> int | None:
        return self.catalog.max_model_len()

    def health(self) -> tuple[bool, dict[str, Any]]:
        return self.catalog.health()

    def start_report(self) -> dict[str, Any] | None:
        return self.catalog.start_report()

    def service_start(self) -> ServiceStart:
        return self.catalog.service_start()

    def engine_snapshot(self) -> EngineSnapshot:
        return self.catalog.engine_snapshot()

    async def adapter_stats(self) -> AdapterStats | None:
        return await self.catalog.adapter_stats()

    async def engine_metrics(self) -> bytes | None:
        return await self.catalog.engine_metrics()

    # ----- admin (``AdminBackend``, ``ModelsAdmin``) --------------------------------------

    def adapters_report(self) -> dict[str, Any]:
        with _refusals_answered():
            return self.catalog.adapters_report()

    def adapter_report(self, name: str) -> dict[str, Any]:
        with _refusals_answered():
            return self.catalog.adapter_report(name)

    def admit_adapter_change(self) -> None:
        with _refusals_answered():
            self.catalog.admit_adapter_change()

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
        with _refusals_answered():
            return await self.catalog.put_adapter(
                name, source, revision, follow, preset, local_roots=local_roots
            )

    async def remove_adapter(self, name: str) -> None:
        with _refusals_answered():
            await self.catalog.remove_adapter(name)

    async def rollback_adapter(self, name: str) -> dict[str, Any]:
        with _refusals_answered():
            return await self.catalog.rollback_adapter(name)

    async def engine_report(self) -> dict[str, Any]:
        return await self.catalog.engine_report()

    async def restart_engine(self) -> EngineSnapshot:
        return await self.catalog.restart_engine()

    def catalog_report(self) -> dict[str, Any]:
        return self.catalog.catalog_report()

    async def load_by_hand(self, model_id: str) -> dict[str, Any]:
        with _refusals_answered():
            return await self.catalog.load_by_hand(model_id)

    async def unload_by_hand(self, model_id: str) -> dict[str, Any]:
        with _refusals_answered():
            return await self.catalog.unload_by_hand(model_id)


class ManagedCatalogBackend(ManagedBackend):
    """A catalog of several base models: every model's engine reported on its own (the
    metrics' engine gauges and the status page, one per model: ``CatalogAdmin``)."""

    def engine_snapshots(self) -> dict[str, EngineSnapshot]:
        return self.catalog.engine_snapshots()


def managed_backend(settings: Settings) -> ManagedBackend:
    """The managed backend ``settings`` ask for: a catalog's, or one model's."""
    kind = ManagedCatalogBackend if settings.models else ManagedBackend
    return kind(settings)
