"""The adapter admin API of one base model's adapters (``AdminBackend``'s adapter half):
list, describe, add, remove and roll back through its adapter manager. A change is refused
while the model is being prepared, and while a fleet manifest owns the adapters (a change here
would diverge from the replicas); an operation's own failure is the manager's ``AdapterError``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loragate.adapters.fleet_reconciler import FleetReconciler
from loragate.adapters.intake.pipeline import admitted_source
from loragate.adapters.manager import AdapterManager
from loragate.serving.errors import NotServing, OwnedByManifest, UnknownAdapter


class AdapterAdmin:
    """Mixed into a model runtime, which owns an adapter manager once prepared."""

    manager: AdapterManager | None
    fleet: FleetReconciler | None

    def require_manager(self) -> AdapterManager:
        if self.manager is None:
            raise NotServing("the gateway is still starting", "engine_starting")
        return self.manager

    def _changeable_manager(self) -> AdapterManager:
        """The manager, for a change to this gateway's adapters: refused when a fleet manifest
        owns them (a change here would diverge from the other replicas)."""
        if self.fleet is not None:
            raise OwnedByManifest(self.fleet.report()["source"])
        return self.require_manager()

    def admit_adapter_change(self) -> None:
        self._changeable_manager()

    def adapters_report(self) -> dict[str, Any]:
        manager = self.require_manager()
        return {
            "base_model": manager.base_name,
            "data": manager.list(),
            # Adds running now or finished lately (a failed add of a new name shows only here).
            "progress": [record.as_dict() for record in manager.progress.all()],
            "adapters_manifest": self.fleet.report() if self.fleet is not None else None,
        }

    def adapter_report(self, name: str) -> dict[str, Any]:
        manager = self.require_manager()
        record = manager.progress.get(name)
        try:
            body = manager.describe(name)
        except KeyError:
            if record is None:
                raise UnknownAdapter(name) from None
            body = {"name": name, "state": record.stage if record.finished else "adding"}
        return {**body, "progress": record.as_dict() if record else None}

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
        manager = self._changeable_manager()
        if local_roots is not None:
            source = await admitted_source(source, local_roots)
        return await manager.put(name, source, revision, follow, preset=preset)

    async def remove_adapter(self, name: str) -> None:
        manager = self._changeable_manager()
        await manager.remove(name)

    async def rollback_adapter(self, name: str) -> dict[str, Any]:
        manager = self._changeable_manager()
        return await manager.rollback(name)
