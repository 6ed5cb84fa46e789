"""The adapter layer for one base model, put together from the settings.

The store and its manifest live under ``CACHE_DIR/adapters``; the manifest is per base model
(a hash of its directory), so two models on one cache dir keep their adapters apart.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from loragate.adapters.manager import AdapterManager
from loragate.adapters.manifest import Manifest
from loragate.adapters.pipeline import AdapterPipeline
from loragate.adapters.source_networks import allow_source_networks
from loragate.adapters.store import AdapterStore
from loragate.settings import Settings
from loragate.supervisor.engine import EngineSupervisor
from loragate.supervisor.engine_client import EngineClient


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
) -> AdapterManager:
    """The manager of ``model_dir``'s adapters: store, manifest and pipeline from ``settings``."""
    # Every source download, follow check and manifest fetch of this process obeys it.
    allow_source_networks(settings.source_networks())
    adapters_root = cache_dir / "adapters"
    store = AdapterStore(adapters_root, max_bytes=settings.store_max_bytes)
    model_key = hashlib.sha256(str(model_dir).encode()).hexdigest()[:16]
    manifest = Manifest(adapters_root / "manifests" / f"{model_key}.json").load()
    pipeline = AdapterPipeline(
        store=store,
        base_dir=model_dir,
        base_config=base_config,
        max_lora_rank=settings.max_lora_rank,
    )
    return AdapterManager(
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
        follow_interval=settings.follow_interval,
    )
