"""How the gateway logs: the level, JSON lines or text, a line per inference request, and
where the engine's own output goes (its log file, rotated by size, and the gateway's stderr)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from loragate.settings.serve_option import serve_option

LogLevel = Literal["debug", "info", "warning", "error", "critical"]


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

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level_in_any_case(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value
