"""loragate: serve your own fine-tuned LoRA adapters locally behind one OpenAI-compatible endpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

    from loragate.gateway.backends.custom import GenerationResult, InferenceBackend

__version__ = "0.1.0"


def create_server(backend: Any = None, config_file: Any = None, **options: Any) -> FastAPI:
    """A configured FastAPI app with the same options as ``gateway serve``.

    ``backend`` may be any ``InferenceBackend``; by default the app supervises a vLLM engine
    (or proxies ``upstream_url`` when that option is given).
    Run it with any ASGI server (``uvicorn.run(app)``) or mount it in a larger app.
    """
    from loragate.gateway.app import create_app
    from loragate.settings import load_settings

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
