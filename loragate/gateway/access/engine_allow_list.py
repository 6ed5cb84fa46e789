"""The engine routes clients may reach through the gateway: an explicit allow-list.

vLLM's API server also serves routes that administer the engine (its raw
``/v1/load_lora_adapter``, ``/abort_requests``, ``/start_profile``, ``/invocations``,
``/scale_elastic_ep``, ``/collective_rpc``, ``/reset_prefix_cache``, ``/sleep`` ...). None of
them is listed here, so none is reachable: the gateway registers a route for each entry
below and nothing else goes through to the engine. Route names are vLLM 0.32's
(``vllm/entrypoints/*/api_router.py``).

Each entry says how the request is shaped (``json``: a JSON object with a ``model`` field;
``multipart``: a form upload with a ``model`` field; ``plain``: no model, nothing to rename
on the way in) and, for a route the engine serves only for some models, what to tell a client
whose engine runs another kind of model.

The table sits beside the routes, not among them: ``routes.passthrough`` registers a handler
for each entry and ``metrics`` labels the requests by them, and metrics imports no route.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Shape = Literal["json", "multipart", "plain"]

_POOLING_HINT = (
    "vLLM serves {path} only for a pooling model (an embedding, scoring or reward model, run "
    "with the engine flag --runner pooling); this gateway's engine runs a generation model. "
    "Use /v1/chat/completions or /v1/completions, or serve a pooling model "
    "(gateway serve --model EMBEDDING_MODEL -- --runner pooling)."
)
_AUDIO_HINT = (
    "vLLM serves {path} only for a speech-to-text model (such as Whisper); this gateway's "
    "engine runs another kind of model. Serve an audio model to transcribe or translate."
)
_RESPONSES_HINT = (
    "This engine does not serve the Responses API for its model. Use /v1/chat/completions."
)
_MESSAGES_HINT = (
    "vLLM serves Anthropic's {path} only for a generation model; this gateway's engine runs "
    "another kind of model (a pooling model: --runner pooling)."
)
_STORE_HINT = (
    "This engine keeps no responses: start the gateway with the environment variable "
    "VLLM_ENABLE_RESPONSES_API_STORE=1 (the engine inherits it) to retrieve or cancel them "
    "by id, and create them with store=true."
)


@dataclass(frozen=True)
class EngineRoute:
    path: str  # as the client sends it; {id} stands for one path segment
    method: Literal["GET", "POST"]
    shape: Shape
    unserved_hint: str | None = None  # why the engine may lack it; {path} is filled in
    streams: bool = False  # whether "stream": true gives server-sent events

    def hint(self, path: str) -> str | None:
        return self.unserved_hint.format(path=path) if self.unserved_hint else None


ENGINE_ROUTES: tuple[EngineRoute, ...] = (
    EngineRoute("/v1/responses", "POST", "json", _RESPONSES_HINT, streams=True),
    EngineRoute("/v1/responses/{id}", "GET", "plain", _STORE_HINT, streams=True),
    EngineRoute("/v1/responses/{id}/cancel", "POST", "plain", _STORE_HINT),
    # Anthropic's Messages API (Claude Code, the Anthropic SDK): vllm/entrypoints/anthropic.
    EngineRoute("/v1/messages", "POST", "json", _MESSAGES_HINT, streams=True),
    EngineRoute("/v1/messages/count_tokens", "POST", "json", _MESSAGES_HINT),
    EngineRoute("/v1/embeddings", "POST", "json", _POOLING_HINT),
    EngineRoute("/pooling", "POST", "json", _POOLING_HINT),
    EngineRoute("/v1/score", "POST", "json", _POOLING_HINT),
    EngineRoute("/score", "POST", "json", _POOLING_HINT),
    EngineRoute("/v1/rerank", "POST", "json", _POOLING_HINT),
    EngineRoute("/rerank", "POST", "json", _POOLING_HINT),
    EngineRoute("/v2/rerank", "POST", "json", _POOLING_HINT),  # Cohere's shape
    EngineRoute("/v2/embed", "POST", "json", _POOLING_HINT),  # Cohere's shape
    EngineRoute("/classify", "POST", "json", _POOLING_HINT),
    EngineRoute("/tokenize", "POST", "json"),
    EngineRoute("/detokenize", "POST", "json"),
    EngineRoute("/version", "GET", "plain"),
    EngineRoute("/v1/audio/transcriptions", "POST", "multipart", _AUDIO_HINT, streams=True),
    EngineRoute("/v1/audio/translations", "POST", "multipart", _AUDIO_HINT, streams=True),
)

_STATIC = {route.path: route for route in ENGINE_ROUTES if "{" not in route.path}
_RESPONSES_PREFIX = "/v1/responses/"


def engine_route(path: str) -> EngineRoute | None:
    """The allow-list entry a request path falls under (templates for ids), if any."""
    route = _STATIC.get(path)
    if route is not None or not path.startswith(_RESPONSES_PREFIX):
        return route
    rest = path[len(_RESPONSES_PREFIX) :]
    response_id, _, action = rest.partition("/")
    if not response_id:
        return None
    template = "/v1/responses/{id}" + (f"/{action}" if action else "")
    return next((r for r in ENGINE_ROUTES if r.path == template), None)
