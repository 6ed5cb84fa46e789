"""The OpenAPI description of the routes that read raw JSON bodies.

The inference routes are plain Starlette routes (no pydantic parsing on the hot path), so
FastAPI cannot describe them; ``install_openapi`` adds them, with request-body schemas that
say what the gateway accepts, plus the OpenAI error shape and the two bearer keys. The
generation parameters' properties come from the table their checks come from
(``parameters.PARAMETERS``), so a documented range is the range checked. Clients, /docs and the
fuzz tests read the result.

``/docs`` is a plain page that links the description (``DOCS_PAGE``): no script at all. An
interactive viewer (Swagger UI, Redoc) would load JavaScript from a CDN into the gateway's own
origin, which the cross-site checks trust (``cross_site``): whoever served that script could
drive the admin routes from the page. Load ``/openapi.json`` into a viewer of your own.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.requests import Request
from starlette.responses import HTMLResponse

from loragate.gateway.generation_routes import GENERATION_ROUTES, Route
from loragate.gateway.requests.chat import ROLES
from loragate.gateway.requests.parameters import Schema, parameter_schemas, parameters_of
from loragate.gateway.requests.vi import HF_TO_OPENAI


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


# The request shapes' top-level properties: ``model`` (routed, not a generation parameter) and
# the rows of the parameter table, which also makes the 400s.
_MODEL: Schema = {
    "type": "string",
    "description": "The base model's id or an adapter's name (see GET /v1/models). "
    "Default: the base model.",
}
_CHAT_PARAMETERS = parameter_schemas("chat")

_CONTENT_PART: Schema = {
    "anyOf": [
        {
            "type": "object",
            "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        },
        {
            "type": "object",
            "required": ["type", "image_url"],
            "properties": {
                "type": {"const": "image_url"},
                "image_url": {
                    "type": "object",
                    "required": ["url"],
                    "properties": {
                        "url": {
                            "type": "string",
                            "description": "A data URI, an http(s) URL, or a path inside "
                            "--allowed-media-dir.",
                        },
                        "detail": {"enum": ["auto", "low", "high"]},
                    },
                },
            },
        },
    ]
}

_MESSAGE: Schema = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": sorted(ROLES)},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": _ref("ContentPart")},
                {"type": "null"},
            ]
        },
        "name": {"type": "string"},
    },
}

_OPENAI_CHAT: Schema = {
    "type": "object",
    "title": "OpenAI chat request",
    "required": ["messages"],
    "properties": {
        "model": _MODEL,
        **_CHAT_PARAMETERS,
        "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
        "response_format": _ref("ResponseFormat"),
    },
}

_VI_CHAT: Schema = {
    "type": "object",
    "title": "Datature Vi request",
    "description": "Becomes one user message: the image part first, then the text part.",
    "required": ["user_prompt"],
    "properties": {
        "model": _MODEL,
        **_CHAT_PARAMETERS,
        "source": {
            "type": "string",
            "minLength": 1,
            "description": "The image: a local path (inside --allowed-media-dir), an http(s) "
            "URL or a data URI.",
        },
        "user_prompt": {"type": "string"},
        "system_prompt": {"type": "string"},
        "generation_config": {
            "type": "object",
            "description": "Hugging Face generation names; top-level parameters win.",
            "properties": {
                **{hf: _CHAT_PARAMETERS[openai] for hf, openai in sorted(HF_TO_OPENAI.items())},
                "do_sample": {"type": "boolean", "description": "false: greedy (temperature 0)."},
            },
            "additionalProperties": False,
        },
    },
}

_RESPONSE_FORMAT: Schema = {
    "anyOf": [
        {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"enum": ["text", "json_object"]}},
        },
        {
            "type": "object",
            "required": ["type", "json_schema"],
            "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {
                    "type": "object",
                    "required": ["schema"],
                    "properties": {
                        "name": {"type": "string"},
                        "schema": {"type": "object", "description": "A JSON Schema."},
                    },
                },
            },
        },
    ]
}

_COMPLETION: Schema = {
    "type": "object",
    "required": [p.name for p in parameters_of("completions") if p.required],
    "properties": {"model": _MODEL, **parameter_schemas("completions")},
}

_ERROR: Schema = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

LOAD_LORA_ADAPTER: Schema = {
    "type": "object",
    "required": ["lora_name", "lora_path"],
    "properties": {
        "lora_name": {"type": "string", "description": "The public adapter name."},
        "lora_path": {
            "type": "string",
            "description": "Any adapter source: a local dir or archive, hf://…, https://…, tinker://…",
        },
    },
}

UNLOAD_LORA_ADAPTER: Schema = {
    "type": "object",
    "required": ["lora_name"],
    "properties": {"lora_name": {"type": "string"}},
}

COMPONENTS: dict[str, Schema] = {
    "ChatCompletionRequest": {"anyOf": [_ref("OpenAIChatRequest"), _ref("ViChatRequest")]},
    "OpenAIChatRequest": _OPENAI_CHAT,
    "ViChatRequest": _VI_CHAT,
    "ChatMessage": _MESSAGE,
    "ContentPart": _CONTENT_PART,
    "ResponseFormat": _RESPONSE_FORMAT,
    "CompletionRequest": _COMPLETION,
    "Error": _ERROR,
}


def json_body(schema: Schema) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads its JSON body itself."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _errors(*codes: int) -> dict[str, Any]:
    return {
        str(code): {
            "description": "An OpenAI-shaped error.",
            "content": {"application/json": {"schema": _ref("Error")}},
        }
        for code in codes
    }


# The generation routes the gateway answers itself (raw-body routes, which FastAPI does not
# describe): each one's summary, request body and operation id.
_OPERATIONS: dict[Route, tuple[str, str, str]] = {
    "chat": ("Chat completion (OpenAI or Vi format)", "ChatCompletionRequest", "chat_completions"),
    "completions": ("Legacy text completion", "CompletionRequest", "completions"),
}


def _inference_operation(summary: str, request: str, operation_id: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "operationId": operation_id,
        "security": [{"apiKey": []}, {}],
        **json_body(_ref(request)),
        "responses": {
            "200": {
                "description": "The answer; with `stream: true`, server-sent events.",
                "content": {"application/json": {}, "text/event-stream": {}},
            },
            **_errors(400, 401, 403, 404, 413, 503),
        },
    }


DOCS_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>loragate API</title></head>
<body>
<h1>loragate API</h1>
<p>This gateway's OpenAPI description is <a href="openapi.json">openapi.json</a>. Open it in an
OpenAPI viewer or client generator of your own (Swagger UI, Redoc, Postman...).</p>
<p>The gateway serves no interactive viewer: its script would run in the gateway's own origin,
which the admin routes trust. The status page is <a href="ui">/ui</a>.</p>
</body></html>
"""
# The page loads nothing, runs nothing and may be framed by nobody.
DOCS_PAGE_POLICY = "default-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"


async def _docs_page(request: Request) -> HTMLResponse:
    return HTMLResponse(DOCS_PAGE, headers={"Content-Security-Policy": DOCS_PAGE_POLICY})


def install_openapi(app: FastAPI, *, docs_page: bool = True) -> None:
    """Make ``app.openapi()`` describe the raw-body inference routes too; with ``docs_page``,
    serve ``DOCS_PAGE`` at ``/docs``."""
    if docs_page:
        app.add_route("/docs", _docs_page, include_in_schema=False)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, routes=app.routes, description=app.description
            )
            paths = schema.setdefault("paths", {})
            for route in GENERATION_ROUTES:
                if route.hot and route.kind is not None:
                    paths[route.path] = {"post": _inference_operation(*_OPERATIONS[route.kind])}
            components = schema.setdefault("components", {})
            components.setdefault("schemas", {}).update(COMPONENTS)
            components["securitySchemes"] = {
                "apiKey": {"type": "http", "scheme": "bearer", "description": "--api-key"},
                "adminKey": {"type": "http", "scheme": "bearer", "description": "--admin-key"},
            }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
