"""The request corpus the Vi SDK's server and loragate are compared on, as data.

Every case is named; ``run.run_corpus`` sends each to both servers (one recording backend
each) and classifies what came back. It covers both request shapes (OpenAI's
``messages``, Vi's flat ``source`` and ``user_prompt``), streamed and not, every generation
parameter, every media form, invalid values, headers and bodies, the other routes, and
backends that misbehave or list no models. ``{MEDIA_URL}``, ``{MEDIA_DIR}`` and
``{OUTSIDE_DIR}`` are written in at run time: a local HTTP server's address, the folder
loragate serves local images from (``allowed_media_dir``) and one outside it.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from PIL import Image


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (0, 200, 0)).save(buffer, format="PNG")
    return buffer.getvalue()


PNG = _png()
PNG_BASE64 = base64.b64encode(PNG).decode()
PNG_URI = "data:image/png;base64," + PNG_BASE64
MODEL = "vi-model"


@dataclass(frozen=True)
class Case:
    """One request: ``body`` sent as JSON (``content`` instead: these characters as they are),
    ``backend``: the recording backend's state while it is served."""

    name: str
    body: Any = None
    method: str = "POST"
    path: str = "/v1/chat/completions"
    headers: Mapping[str, str] = field(default_factory=dict)
    content: str | None = None
    backend: Mapping[str, Any] = field(default_factory=dict)


def openai(name: str, content: Any = "hello", **fields: Any) -> Case:
    """An OpenAI-shaped request: one user message."""
    return Case(
        name, {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}
    )


def vi(name: str, prompt: str | None = "what is this?", **fields: Any) -> Case:
    """A Vi-shaped request: ``user_prompt`` (and ``source`` when given)."""
    prompt_field = {} if prompt is None else {"user_prompt": prompt}
    return Case(name, {"model": MODEL, **prompt_field, **fields})


def in_every_shape(name: str, text: str = "hello", **fields: Any) -> list[Case]:
    """``fields`` in both shapes, streamed and not, asking ``text``."""
    return [
        openai(f"openai-{name}", text, **fields),
        openai(f"openai-{name}-stream", text, **fields, stream=True),
        vi(f"vi-{name}", text, **fields),
        vi(f"vi-{name}-stream", text, **fields, stream=True),
    ]


def image_part(url: Any) -> list[dict[str, Any]]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what?"}]


SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "Caption",
        "schema": {
            "type": "object",
            "properties": {
                "caption": {"type": "string"},
                "boxes": {"type": "array", "items": {"type": "integer"}},
                "score": {"type": "number"},
                "kind": {"enum": ["cat", "dog"]},
                "where": {"type": "object", "properties": {"x": {"type": "integer"}}},
            },
            "required": ["caption"],
        },
    },
}

# Every generation parameter, with a value both servers take.
PARAMETERS: dict[str, dict[str, Any]] = {
    "plain": {},
    "temperature-0": {"temperature": 0},
    "temperature": {"temperature": 0.2},
    "temperature-2": {"temperature": 2},
    "max-tokens": {"max_tokens": 5},
    "top-p": {"top_p": 0.9},
    "top-k": {"top_k": 5},
    "seed": {"seed": 7},
    "stop": {"stop": "END"},
    "stop-list": {"stop": ["END", "STOP"]},
    "stop-cuts": {"stop": " to"},
    "repetition-penalty": {"repetition_penalty": 1.1},
    "frequency-penalty": {"frequency_penalty": 0.5},
    "presence-penalty": {"presence_penalty": 0.3},
    "all-penalties": {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 1},
    "logit-bias": {"logit_bias": {"12": 1.5}},
    "n-2": {"n": 2},
    "max-completion-tokens": {"max_completion_tokens": 5},
    "min-p": {"min_p": 0.1},
    "user": {"user": "someone"},
    "include-usage": {"stream_options": {"include_usage": True}},
    "schema": {"response_format": SCHEMA},
    "json-object": {"response_format": {"type": "json_object"}},
}

SHAPES = [case for name, fields in PARAMETERS.items() for case in in_every_shape(name, **fields)]

STRUCTURED = [
    openai("response-format-text", response_format={"type": "text"}),
    openai("response-format-unknown-type", response_format={"type": "xml"}),
    openai(
        "response-format-array-schema",
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "L", "schema": {"type": "array"}},
        },
    ),
    openai(
        "response-format-no-schema",
        response_format={"type": "json_schema", "json_schema": {"name": "E"}},
    ),
    openai("guided-json", guided_json={"type": "object", "properties": {"a": {"type": "string"}}}),
    openai("response-format-string", response_format="json"),
]

GENERATION_CONFIG = [
    vi(
        "generation-config",
        generation_config={"max_new_tokens": 9, "top_p": 0.5, "temperature": 1.5},
    ),
    vi(
        "generation-config-under-temperature", temperature=0, generation_config={"temperature": 1.5}
    ),
    vi("generation-config-greedy", generation_config={"do_sample": False}),
    vi("generation-config-stop-strings", generation_config={"stop_strings": ["END"]}),
    vi("generation-config-unknown-key", generation_config={"num_beams": 4}),
    vi("generation-config-not-an-object", generation_config="fast"),
    openai("generation-config-openai-shape", generation_config={"max_new_tokens": 9}),
]

MEDIA = [
    openai("image-data-uri", image_part(PNG_URI)),
    openai("image-raw-base64", image_part(PNG_BASE64)),
    openai("image-http-url", image_part("{MEDIA_URL}/pic.png")),
    openai("image-http-url-not-an-image", image_part("{MEDIA_URL}/notes.txt")),
    openai("image-http-url-missing", image_part("{MEDIA_URL}/missing.png")),
    openai("image-file-path", image_part("{MEDIA_DIR}/pic.png")),
    openai("image-file-path-outside", image_part("{OUTSIDE_DIR}/pic.png")),
    openai("image-file-url", image_part("file://{MEDIA_DIR}/pic.png")),
    openai("image-corrupt-data-uri", image_part("data:image/png;base64,AAAAAAAA")),
    openai("image-undecodable-data-uri", image_part("data:image/png;base64,!!not base64!!")),
    openai("image-url-a-string", [{"type": "image_url", "image_url": PNG_URI}]),
    openai(
        "image-vi-part",
        [{"type": "image", "image": "{MEDIA_DIR}/pic.png"}, {"type": "text", "text": "q"}],
    ),
    openai("image-unknown-part", [{"type": "audio", "audio": "x"}, {"type": "text", "text": "q"}]),
    openai("image-data-uri-stream", image_part(PNG_URI), stream=True),
    vi("source-data-uri", source=PNG_URI),
    vi("source-raw-base64", source=PNG_BASE64),
    vi("source-http-url", source="{MEDIA_URL}/pic.png"),
    vi("source-http-url-not-an-image", source="{MEDIA_URL}/notes.txt"),
    vi("source-file-path", source="{MEDIA_DIR}/pic.png"),
    vi("source-file-path-outside", source="{OUTSIDE_DIR}/pic.png"),
    vi("source-missing-file", source="{MEDIA_DIR}/missing.png"),
    vi("source-corrupt-data-uri", source="data:image/png;base64,AAAAAAAA"),
    vi("source-empty", source=""),
    vi("source-only", prompt=None, source=PNG_URI),
    vi("source-data-uri-stream", source=PNG_URI, stream=True),
    vi("source-http-url-stream", source="{MEDIA_URL}/pic.png", stream=True),
]

Q = {"role": "user", "content": "q"}
MESSAGES = [
    Case(
        "system-and-user",
        {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, Q]},
    ),
    Case(
        "multi-turn",
        {
            "model": MODEL,
            "messages": [
                Q,
                {"role": "assistant", "content": "a"},
                {"role": "user", "content": "b"},
            ],
        },
    ),
    openai("text-parts", [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]),
    Case("message-extra-field", {"model": MODEL, "messages": [{**Q, "name": "ann"}]}),
    Case(
        "developer-role", {"model": MODEL, "messages": [{"role": "developer", "content": "x"}, Q]}
    ),
    Case(
        "tool-role",
        {"model": MODEL, "messages": [Q, {"role": "tool", "content": "4", "tool_call_id": "c"}]},
    ),
    Case(
        "function-role",
        {"model": MODEL, "messages": [Q, {"role": "function", "content": "4", "name": "f"}]},
    ),
    Case("null-content", {"model": MODEL, "messages": [Q, {"role": "assistant", "content": None}]}),
    openai("number-content", 5),
    Case("message-without-role", {"model": MODEL, "messages": [{"content": "q"}]}),
    Case("messages-empty", {"model": MODEL, "messages": []}),
    Case("messages-a-string", {"model": MODEL, "messages": "hello"}),
]

INVALID = [
    *[
        openai(f"{name}={value!r}", **{name: value})
        for name, value in [
            ("temperature", 3),
            ("temperature", -1),
            ("temperature", "0.5"),
            ("temperature", "hot"),
            ("temperature", True),
            ("max_tokens", 0),
            ("max_tokens", 5.0),
            ("max_tokens", "5"),
            ("max_tokens", 2.5),
            ("top_p", 1.5),
            ("top_p", 0),
            ("top_k", 0),
            ("top_k", 2.0),
            ("repetition_penalty", -1),
            ("repetition_penalty", 0),
            ("frequency_penalty", 3),
            ("seed", "x"),
            ("seed", 1.5),
            ("stop", 5),
            ("stop", [1]),
            ("logit_bias", {"12": "high"}),
            ("stream", "true"),
            ("stream", 1),
            ("stream", "yes"),
            ("n", 0),
            ("n", 200),
            ("logprobs", True),
            ("logprobs", False),
            ("top_logprobs", 2),
            ("unknown_field", 1),
        ]
    ],
    openai("tools", tools=[{"type": "function", "function": {"name": "f"}}]),
    openai("functions", functions=[{"name": "f"}]),
    Case("no-model", {"messages": [Q]}),
    Case("null-model", {"model": None, "messages": [Q]}),
    Case("unknown-model", {"model": "nope", "messages": [Q]}),
    Case("number-model", {"model": 5, "messages": [Q]}),
    vi("user-prompt-a-number", prompt=5),  # type: ignore[arg-type]
    vi("source-a-number", source=5),
    vi("system-prompt", system_prompt="Be brief."),
    Case("both-shapes", {"model": MODEL, "user_prompt": "x", "messages": [Q]}),
    Case("neither-shape", {"model": MODEL}),
]

BACKEND_BEHAVIOUR = [
    *in_every_shape("backend-value-error", "explode"),
    *in_every_shape("backend-runtime-error", "crash"),
    openai("backend-fails-midway-stream", "fail-midway now", stream=True),
    vi("backend-fails-midway-vi-stream", prompt="fail-midway now", stream=True),
    openai("backend-reports-no-usage", "no-usage"),
    vi("backend-reports-no-usage-vi", prompt="no-usage"),
    openai("backend-cut-short", "cut-short"),
    openai("backend-streams-none", "none-piece here", stream=True),
]

FOREIGN_ORIGIN = {"Origin": "https://evil.example"}
JSON_BODY = '{"model": "vi-model", "messages": [{"role": "user", "content": "hi"}]}'
HEADERS = [
    Case("no-content-type", content=JSON_BODY),
    Case("text-plain", content=JSON_BODY, headers={"Content-Type": "text/plain"}),
    Case(
        "form-content-type",
        content=JSON_BODY,
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    ),
    Case(
        "json-charset",
        content=JSON_BODY,
        headers={"Content-Type": "application/json; charset=utf-8"},
    ),
    Case("malformed-json", content='{"model": ', headers={"Content-Type": "application/json"}),
    Case("empty-body", content="", headers={"Content-Type": "application/json"}),
    Case("json-array", content="[]", headers={"Content-Type": "application/json"}),
    Case("json-null", content="null", headers={"Content-Type": "application/json"}),
    Case("foreign-origin", openai("-", "hi").body, headers=FOREIGN_ORIGIN),
    Case("foreign-host", openai("-", "hi").body, headers={"Host": "evil.example"}),
    Case("localhost-host", openai("-", "hi").body, headers={"Host": "localhost"}),
    Case("request-id-sent", openai("-", "hi").body, headers={"X-Request-ID": "corpus-42"}),
    Case("bearer-token", openai("-", "hi").body, headers={"Authorization": "Bearer sk-anything"}),
    Case("accept-event-stream", openai("-", "hi").body, headers={"Accept": "text/event-stream"}),
    Case(
        "preflight",
        method="OPTIONS",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    ),
    Case("health-foreign-origin", method="GET", path="/health", headers=FOREIGN_ORIGIN),
    Case(
        "models-foreign-origin",
        method="GET",
        path="/v1/models",
        headers=FOREIGN_ORIGIN,
    ),
]

ROUTES = [
    Case(f"get {path}", method="GET", path=path)
    for path in [
        "/health",
        "/v1/health",
        "/v1/models",
        f"/v1/models/{MODEL}",
        "/v1/models/nope",
        "/v1/chat/completions",
        "/",
        "/openapi.json",
        "/docs",
        "/redoc",
        "/metrics",
    ]
] + [
    Case("head /health", method="HEAD", path="/health"),
    Case("post /v1/completions", {"model": MODEL, "prompt": "hi"}, path="/v1/completions"),
    Case("post /v1/embeddings", {"model": MODEL, "input": "hi"}, path="/v1/embeddings"),
]

FAILING = {"models_fail": True}
TWO = {"models": [MODEL, "vi-other"]}
BACKEND_STATE = [
    Case("models-fail get /health", method="GET", path="/health", backend=FAILING),
    Case("models-fail get /v1/models", method="GET", path="/v1/models", backend=FAILING),
    Case("models-fail chat", openai("-").body, backend=FAILING),
    Case("models-fail chat-stream", openai("-", stream=True).body, backend=FAILING),
    Case("no-models get /health", method="GET", path="/health", backend={"models": []}),
    Case("no-models chat", openai("-").body, backend={"models": []}),
    Case("two-models get /v1/models", method="GET", path="/v1/models", backend=TWO),
    Case("two-models chat-second", {**openai("-").body, "model": "vi-other"}, backend=TWO),
]

CASES: list[Case] = [
    *SHAPES,
    *STRUCTURED,
    *GENERATION_CONFIG,
    *MEDIA,
    *MESSAGES,
    *INVALID,
    *BACKEND_BEHAVIOUR,
    *HEADERS,
    *ROUTES,
    *BACKEND_STATE,
]

assert len({case.name for case in CASES}) == len(CASES), "case names must be unique"
