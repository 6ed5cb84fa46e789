"""How the gateway logs: the level, JSON lines or text, a line per inference request, and
where the engine's own output goes (its log file, rotated by size, and the gateway's stderr)."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from loragate.settings.serve_option import serve_option

LogLevel = Literal["debug", "info", "warning", "error", "critical"]


def _otlp_traces_endpoint_from_env() -> str | None:
    """The OpenTelemetry standard variables' traces endpoint (OTLP over HTTP): the traces
    one as is, the generic one plus ``/v1/traces`` (the spec's rule); none when
    ``OTEL_TRACES_EXPORTER`` or ``OTEL_SDK_DISABLED`` turn tracing off."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return None
    traces = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if traces:
        return traces
    generic = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    return generic.rstrip("/") + "/v1/traces" if generic else None


class ObservabilityFields(BaseModel):
    log_json: bool = Field(
        default=False, description="Log as JSON lines.", json_schema_extra=serve_option()
    )
    access_log: bool = Field(
        default=False,
        description="Log one line per inference request (request id, model, status, duration).",
        json_schema_extra=serve_option(),
    )
    log_level: LogLevel = Field(
        default="info", description="Log level.", json_schema_extra=serve_option()
    )

    engine_log_to_stderr: bool = Field(
        default=True,
        description=(
            "Also copy the engine's output to the gateway's stderr, each line after "
            "'engine | ' (it always goes to CACHE_DIR/logs/engine.log)."
        ),
        json_schema_extra=serve_option("--engine-log-to-stderr/--no-engine-log-to-stderr"),
    )
    engine_log_max_bytes: int = Field(
        default=20 * 1024 * 1024,
        ge=64 * 1024,
        description=(
            "Rotate CACHE_DIR/logs/engine.log past this size, while the engine runs too "
            "(engine.log.1 to .3 are kept)."
        ),
        json_schema_extra=serve_option(),
    )

    otlp_traces_endpoint: str | None = Field(
        default_factory=_otlp_traces_endpoint_from_env,
        description=(
            "Send the gateway's own spans (OTLP over HTTP, e.g. "
            "http://collector:4318/v1/traces) and pass this to the engine's "
            "--otlp-traces-endpoint; defaults from OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
            "OTEL_EXPORTER_OTLP_ENDPOINT. Needs the 'otel' extra."
        ),
        json_schema_extra=serve_option(),
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level_in_any_case(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value
