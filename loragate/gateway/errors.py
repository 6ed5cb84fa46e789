"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from loragate.adapters.errors import AdapterError
from loragate.gateway.observe.metrics import current_observation
from loragate.serving.errors import (
    AmbiguousBase,
    ModelNotFound,
    NotServing,
    OwnedByManifest,
    ServingError,
    UnknownAdapter,
)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type_ or _TYPES.get(
            status, "api_error" if status >= 500 else "invalid_request_error"
        )
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        """The error's answer, with the request's id when it is an inference request (the
        gateway's own refusals carry it as the engine's answers do)."""
        headers = self.headers
        observation = current_observation.get()
        if observation is not None and observation.request_id and "X-Request-ID" not in headers:
            headers = {**headers, "X-Request-ID": observation.request_id}
        return Response(
            orjson.dumps(self.body()),
            status_code=self.status,
            media_type="application/json",
            headers=headers,
        )


def model_not_found(model: str, valid: list[str]) -> OpenAIError:
    return openai_error_of(ModelNotFound(model, valid))


# The status each refusal of the serving core answers with (a new kind: its parent's).
_SERVING_STATUS: dict[type, int] = {
    ModelNotFound: 404,
    NotServing: 503,
    UnknownAdapter: 404,
    OwnedByManifest: 409,
    AmbiguousBase: 400,
}


def openai_error_of(exc: ServingError | AdapterError) -> OpenAIError:
    """A refusal of the serving core, or an adapter operation's failure, as a client sees it:
    a model nobody serves a 404 on ``model``, a model that cannot take it now a 503 with its
    ``Retry-After``, an adapter's failure with the status it names."""
    if isinstance(exc, AdapterError):
        return OpenAIError(exc.status, str(exc), code=exc.code)
    retry_after = exc.retry_after if isinstance(exc, NotServing) else None
    status = next((_SERVING_STATUS[k] for k in type(exc).__mro__ if k in _SERVING_STATUS), 500)
    return OpenAIError(
        status,
        exc.message,
        code=exc.code,
        param="model" if isinstance(exc, ModelNotFound) else None,
        headers={"Retry-After": str(retry_after)} if retry_after is not None else None,
    )


def client_closed() -> OpenAIError:
    """The 499 (nginx's "client closed request") recorded for a client that left."""
    return OpenAIError(
        499, "the client closed the connection before its answer", code="client_closed_request"
    )


def nested_too_deeply() -> OpenAIError:
    """The 400 for a ``RecursionError`` while answering: nesting that no check expected
    (bodies are capped when parsed, ``requests.body``), a bad request all the same, and no
    traceback of a thousand frames in the log."""
    return OpenAIError(
        400,
        "The request nests too deeply for this gateway to handle; flatten it.",
        code="body_too_deep",
    )


def error_event(message: str, code: str, status: int = 503) -> bytes:
    """A server-sent event carrying an OpenAI-shaped error, for a stream that breaks midway."""
    body = OpenAIError(status, message, code=code).body()
    return b"data: " + orjson.dumps(body) + b"\n\ndata: [DONE]\n\n"


def install_error_handlers(app: FastAPI) -> None:
    async def on_openai_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, OpenAIError)
        return exc.response()

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404 and exc.detail == "Not Found":
            # OpenAI's own wording for a path it does not serve, and where to look instead.
            return OpenAIError(
                404,
                f"Invalid URL ({request.method} {request.url.path[:200]}): this gateway serves "
                "the OpenAI API under /v1 and its admin API under /admin (GET /docs lists "
                "every route).",
                code="unknown_url",
            ).response()
        return OpenAIError(
            exc.status_code, str(exc.detail), headers=dict(exc.headers or {})
        ).response()

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = (
            f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg"))
        )
        return OpenAIError(400, message, param=where or None, code="invalid_request").response()

    async def on_client_gone(request: Request, exc: Exception) -> Response:
        # The client left before its body was read whole: nobody reads this answer, but the
        # metrics and the access log record it as nginx does, not as the gateway's failure.
        return client_closed().response()

    async def on_recursion(request: Request, exc: Exception) -> Response:
        return nested_too_deeply().response()

    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ClientDisconnect, on_client_gone)
    app.add_exception_handler(RecursionError, on_recursion)
