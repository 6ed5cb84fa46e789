"""How the gateway logs: the level, JSON lines or text, and a line per inference request."""

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

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level_in_any_case(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value
