"""How the adapters are kept: how often their sources (and the fleet manifest) are checked
for new versions, how much disk the adapter store may take, and which private networks their
downloads may reach."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import NoDecode

from loragate.http.addresses import AllowedNetworks
from loragate.paths import default_state_dir
from loragate.settings.serve_option import serve_option


class AdapterStoreFields(BaseModel):
    state_dir: Path | None = Field(
        default_factory=default_state_dir,
        description=(
            "The runtime adapter manifest (adapters added at runtime: state, not cache) "
            "(default: $STATE_DIRECTORY under systemd, else the cache dir)."
        ),
        json_schema_extra=serve_option(),
    )
    follow_interval: float = Field(
        default=30.0,
        gt=0,
        description=(
            "Seconds between checks of followed sources, the adapters manifest and the store's "
            "live versions."
        ),
    )
    store_max_bytes: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Size of the adapter store past which least-recently-used versions are evicted "
            "(never an adapter's active or previous one). Default: no limit."
        ),
    )
    # A manifest cut short must not empty every replica at once: a pass that would remove
    # more adapters than this removes none and reports why (raise it for a planned clean-up).
    fleet_max_removals: int = Field(
        default=10, ge=0, description="Adapters one pass over the adapters manifest may remove."
    )
    allowed_source_networks: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description=(
            "Private networks (CIDRs such as 10.0.0.0/8) or exact host names that adapter "
            "URLs, the fleet manifest URL and hub endpoints may reach (comma-separated or "
            "repeated). Off the list, a loopback, private or link-local address is refused."
        ),
        json_schema_extra=serve_option(),
    )

    @field_validator("allowed_source_networks", mode="before")
    @classmethod
    def _split_networks(cls, value: Any) -> Any:
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list):
            return value
        entries = [part.strip() for item in values for part in str(item).split(",")]
        entries = [entry for entry in entries if entry]
        AllowedNetworks.parse(entries)  # ValueError naming an entry that is neither
        return entries

    def source_networks(self) -> AllowedNetworks:
        """``allowed_source_networks`` as the allow-list every source download checks."""
        return AllowedNetworks.parse(self.allowed_source_networks)
