"""The adapter manager's counters, as one frozen value for metrics and status routes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterStats:
    loads: int  # adapter versions loaded into the engine
    swaps: int  # a public name moved to a new version
    load_failures: int
    unloads: int  # retired versions unloaded after draining
    store_repairs: int  # live versions found modified on disk and stored again
    last_load_seconds: float | None
    served: int  # public adapter names served now, the base model excluded
    store_bytes: int | None  # None when the store could not be sized
    store_evictions: int
