"""How the adapters are kept: how often their sources (and the fleet manifest) are checked
for new versions, and how much disk the adapter store may take."""

from __future__ import annotations

from pydantic import BaseModel, Field


class AdapterStoreFields(BaseModel):
    follow_interval: float = Field(default=30.0, gt=0)
    store_max_bytes: int | None = Field(default=None, ge=0)
    # A manifest cut short must not empty every replica at once: a pass that would remove
    # more adapters than this removes none and reports why (raise it for a planned clean-up).
    fleet_max_removals: int = Field(default=10, ge=0)
