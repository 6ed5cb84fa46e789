"""How the adapters are kept: how often their sources (and the fleet manifest) are checked
for new versions, how much disk the adapter store may take, which private networks their
downloads may reach, and which local directories an admin client may name as a source."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import NoDecode

from loragate.http.addresses import AllowedNetworks
from loragate.paths import default_state_dir
from loragate.settings.serve_option import serve_option
from loragate.settings.sources import list_value


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

    # The admin key opens the adapters, not the files of the gateway's user: a local path sent
    # to the admin API is read only under these (docs/security.md). Sources the operator
    # configured (--lora, the adapters manifest, a catalog) are read wherever they are.
    adapter_source_roots: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description=(
            "Directories under which the admin API reads local adapter sources (repeatable; "
            "'/' for any). Default: none, so with --admin-key or --open-admin a local path "
            "sent to the admin API is refused; the CLI on this machine, with the per-start "
            "token, may name any."
        ),
        json_schema_extra=serve_option("--adapter-source-root"),
    )

    @field_validator("adapter_source_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        values = list_value("adapter_source_roots", value)
        if not isinstance(values, list):
            return values
        roots = []
        for item in values:
            root = Path(str(item)).expanduser()
            if not root.is_absolute():
                raise ValueError(f"adapter source root {str(item)!r} is not an absolute path")
            roots.append(str(root))
        return roots

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

    def source_roots(self) -> list[Path]:
        """``adapter_source_roots`` as the directories an admin client's local sources need."""
        return [Path(root) for root in self.adapter_source_roots]

    def source_networks(self) -> AllowedNetworks:
        """``allowed_source_networks`` as the allow-list every source download checks."""
        return AllowedNetworks.parse(self.allowed_source_networks)
