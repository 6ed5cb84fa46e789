"""loragate: serve your own fine-tuned LoRA adapters locally behind one OpenAI-compatible endpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

__version__ = "0.1.0"


def create_server(backend: Any = None, config_file: Any = None, **options: Any) -> FastAPI:
    """A configured FastAPI app with the same options as ``gateway serve``.

    ``backend`` may be any ``InferenceBackend``; by default the app supervises a vLLM engine.
    Run it with any ASGI server (``uvicorn.run(app)``) or mount it in a larger app.
    """
    from loragate.gateway.app import create_app
    from loragate.settings import load_settings

    settings = load_settings(config_file, **options)
    return create_app(settings, backend=backend)


__all__ = ["__version__", "create_server"]
