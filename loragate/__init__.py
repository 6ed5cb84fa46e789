"""loragate: serve your own fine-tuned LoRA adapters locally behind one OpenAI-compatible endpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

    from loragate.gateway.backends.custom import GenerationResult, InferenceBackend

__version__ = "0.1.0"


# What the Vi SDK's create_server passes on to its model loader (vi/inference/vi_model.py:
# ViModel.__init__, and its loader's keywords), with what loragate takes instead.
_VI_MODEL_KEYWORDS = {
    "endpoint": "loragate reaches Datature Vi through the vi-sdk package's own settings",
    "ckpt": "loragate serves a run's latest checkpoint",
    "save_path": "use cache_dir=... (loragate keeps its own store)",
    "loader_key": "the engine picks the loader from the model's config.json",
    "overwrite": "loragate verifies its store and fetches again what is damaged",
    "trust_remote_code": "pass engine flags as engine_args=['--trust-remote-code']",
    "quantization": "pass engine flags as engine_args=['--quantization', 'fp8']",
    "device_map": "pass engine flags as engine_args=[...] (e.g. '--tensor-parallel-size')",
    "attn_implementation": "the engine picks its attention backend",
}


def create_server(backend: Any = None, config_file: Any = None, **options: Any) -> FastAPI:
    """A configured FastAPI app with the same options as ``gateway serve``.

    ``backend`` may be any ``InferenceBackend``: loragate's, or the Vi SDK's own
    (``vi.deployment.local.backends.InferenceBackend``), served as the Vi server serves it;
    by default the app supervises a vLLM engine (or proxies ``upstream_url`` when that option
    is given). The keywords are settings, under their names or the Vi SDK's
    (``vi.deployment.local.server.create_server``: ``pretrained_model_name_or_path``,
    ``run_id``, ``secret_key``, ``organization_id``, ``model_name``); a keyword the Vi SDK
    would pass on to its model loader is refused naming it and what loragate takes instead.
    Run it with any ASGI server (``uvicorn.run(app)``) or mount it in a larger app.
    """
    from loragate.gateway.app import create_app
    from loragate.settings import SettingsError, load_settings

    if refused := [name for name in options if name in _VI_MODEL_KEYWORDS]:
        raise SettingsError(
            [
                f"create_server keyword '{name}' is one the Vi SDK passes to its model loader; "
                f"loragate takes none: {_VI_MODEL_KEYWORDS[name]}"
                for name in refused
            ]
        )
    if "pretrained_model_name_or_path" in options:  # the Vi SDK's name, as `gateway serve` takes it
        options["model"] = options.pop("pretrained_model_name_or_path")
    settings = load_settings(config_file, **options)
    return create_app(settings, backend=backend)


def __getattr__(name: str) -> Any:
    # Imported on first use, so `import loragate` stays light for the engine and demo builders.
    if name in ("InferenceBackend", "GenerationResult"):
        from loragate.gateway.backends import custom

        return getattr(custom, name)
    raise AttributeError(f"module 'loragate' has no attribute {name!r}")


__all__ = ["GenerationResult", "InferenceBackend", "__version__", "create_server"]
