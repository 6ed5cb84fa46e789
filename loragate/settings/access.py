"""Where the gateway keeps its files and who may reach what: the cache dir (which also holds
the per-start admin token), local media, API and admin keys, CORS, allowed hosts, the docs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import NoDecode

from loragate.paths import default_cache_dir
from loragate.settings.serve_option import serve_option


class AccessFields(BaseModel):
    # Files.
    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="Adapters, models, manifests, logs.",
        json_schema_extra=serve_option(),
    )
    allowed_media_dir: Path | None = Field(
        default=None,
        description="Requests may read local images from this dir only.",
        json_schema_extra=serve_option("--allowed-media-dir", "--allowed-local-media-path"),
    )

    # Access.
    api_key: list[str] = Field(
        default_factory=list,
        description="Inference API key (repeatable).",
        json_schema_extra=serve_option(),
    )
    api_key_file: Path | None = Field(
        default=None,
        description="File of inference API keys, one a line (# comments); kept out of `ps`.",
        json_schema_extra=serve_option(),
    )
    admin_key: str | None = Field(
        default=None, description="Key for the admin routes.", json_schema_extra=serve_option()
    )
    metrics_public: bool = Field(
        default=True, description="Serve /metrics without a key (off: the admin key's)."
    )
    cors_origins: list[str] = Field(
        default_factory=list,
        description="Allow browser requests from this origin (repeatable; CORS is off by default).",
        json_schema_extra=serve_option("--cors-origin", "--allowed-origins"),
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description=(
            "Host names admin requests may be addressed to, besides loopback names and --host "
            "(comma-separated or repeated; '*.example.com' for subdomains, '*' for any). "
            "Defends the admin API against DNS rebinding."
        ),
        json_schema_extra=serve_option(),
    )
    open_admin: bool = Field(
        default=False,
        description=(
            "Serve the admin routes without any key, to clients on this machine only: a "
            "loopback peer whose request carries no proxy's header. Unsafe behind any local "
            "proxy or tunnel that adds no such header (nginx's plain proxy_pass, socat, "
            "ssh -L): it makes every remote client a loopback peer. Off: without --admin-key, "
            "a per-start token in CACHE_DIR/admin-token is the key."
        ),
        json_schema_extra=serve_option(),
    )
    docs: bool = Field(
        default=True,
        description="Serve /openapi.json, and /docs: a plain page linking it (no script).",
        json_schema_extra=serve_option("--docs/--no-docs"),
    )

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_host_names(cls, value: Any) -> Any:
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list):
            return value
        names = (part.strip().lower() for item in values for part in str(item).split(","))
        return [name for name in names if name]

    def inference_keys(self) -> list[str]:
        keys = list(self.api_key)
        if self.api_key_file is not None:
            lines = self.api_key_file.expanduser().read_text(encoding="utf-8").splitlines()
            keys += [key for key in map(str.strip, lines) if key and not key.startswith("#")]
        return keys
