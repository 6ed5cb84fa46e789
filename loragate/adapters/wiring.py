"""The adapter layer for one base model, put together from the settings: the manager, and the
watchers (``watch``, ``fleet_reconciler``) handed the manager through their protocols.

The store (content-addressed: a cache) lives under ``CACHE_DIR/adapters``, the manifest (what
was added at runtime: state) under ``STATE_DIR/adapters/manifests``, which is the cache dir's own
path when no state dir is set. The manifest is per base model (a hash of its directory), so two
models on one cache dir keep their adapters apart.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from loragate.adapters.fleet_reconciler import FleetReconciler
from loragate.adapters.intake.pipeline import AdapterPipeline, sidecar_preset
from loragate.adapters.manager import AdapterManager
from loragate.adapters.manifest import Manifest, manifest_key
from loragate.adapters.preset import ParameterRules
from loragate.adapters.store import AdapterStore, write_atomic
from loragate.adapters.watch import AdapterFollower, StoreWatch
from loragate.fetching.source_networks import allow_source_networks
from loragate.settings import Settings
from loragate.supervisor.client import EngineClient
from loragate.supervisor.engine import EngineSupervisor

log = logging.getLogger("loragate.adapters")


def manifest_path_for(state_dir: Path | None, cache_dir: Path, model_dir: Path) -> Path:
    """Where ``model_dir``'s runtime manifest is kept: under the state dir (the cache dir when
    none is set). A manifest that only the cache dir holds, as every loragate before the state
    dir kept it, is moved over first, so a unit that gains a ``StateDirectory=`` keeps its
    adapters."""
    relative = Path("adapters") / "manifests" / f"{manifest_key(model_dir)}.json"
    path = (state_dir or cache_dir).expanduser().absolute() / relative
    old = cache_dir.expanduser().absolute() / relative
    if old != path and old.is_file() and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written whole before the old one goes (the two may be on different filesystems);
        # owner-only, as Manifest.save writes it.
        write_atomic(path, old.read_text(encoding="utf-8"), 0o600)
        old.unlink()
        log.info("moved the adapter manifest %s to the state dir: %s", old, path)
    return path


def adapter_manager_for(
    settings: Settings,
    cache_dir: Path,
    model_dir: Path,
    base_config: dict[str, Any],
    *,
    engine: EngineClient,
    supervisor: EngineSupervisor,
    base_name: str,
    zero_adapter: bool,
    preset_rules: ParameterRules | None = None,
) -> AdapterManager:
    """The manager of ``model_dir``'s adapters: store, manifest and pipeline from ``settings``."""
    # Every source download, follow check and manifest fetch of this process obeys it.
    allow_source_networks(settings.source_networks())
    adapters_root = cache_dir / "adapters"
    store = AdapterStore(adapters_root, max_bytes=settings.store_max_bytes)
    manifest = Manifest(manifest_path_for(settings.state_dir, cache_dir, model_dir)).load()
    pipeline = AdapterPipeline(
        store=store,
        base_dir=model_dir,
        base_config=base_config,
        max_lora_rank=settings.max_lora_rank,
        preset_rules=preset_rules,
    )
    manager = AdapterManager(
        store=store,
        manifest=manifest,
        engine=engine,
        supervisor=supervisor,
        base_name=base_name,
        base_config=base_config,
        prepare=pipeline,
        zero_adapter_root=adapters_root / "zero" if zero_adapter else None,
        drain_timeout=settings.drain_timeout,
        ready_timeout=settings.queue_deadline,
        preset_rules=preset_rules,
        # The base model's own preset: a loragate.json in its directory, as beside an adapter.
        base_preset=sidecar_preset(model_dir, f"the base model {base_name}", preset_rules),
    )
    # The watchers reach the manager through their protocols only (``watch``): handed it here.
    interval = settings.follow_interval
    manager.watch_with(AdapterFollower(manager, interval), StoreWatch(manager, store, interval))
    return manager


def fleet_reconciler_for(
    settings: Settings, manager: AdapterManager, base: str | None = None
) -> FleetReconciler | None:
    """What converges ``manager`` on ``--adapters-manifest``, handed the manager as its
    protocol; None when no manifest is set (the admin API alone changes the adapters). A
    catalog's model (``base``) follows its own part of a per-base-model manifest."""
    if not settings.adapters_manifest:
        return None
    return FleetReconciler(
        manager,
        settings.adapters_manifest,
        settings.follow_interval,
        max_removals=settings.fleet_max_removals,
        base=base,
    )
