"""How the adapters are kept: how often their sources (and the fleet manifest) are checked
for new versions, and how much disk the adapter store may take."""

from __future__ import annotations

from pydantic import BaseModel, Field


class AdapterStoreFields(BaseModel):
    follow_interval: float = Field(default=30.0, gt=0)
    store_max_bytes: int | None = Field(default=None, ge=0)
