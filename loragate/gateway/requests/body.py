"""Reading and checking a JSON request body before anything reaches a backend."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request

from loragate.gateway.errors import OpenAIError


async def read_json_object(
    request: Request, max_bytes: int, limit_name: str = "--max-body-bytes"
) -> dict[str, Any]:
    """The body as a JSON object; 415 unless declared JSON, 413 past ``max_bytes`` (the limit
    ``limit_name`` names), 400 for anything that is not one."""
    check_json_content_type(request.headers.get("content-type"))
    check_declared_length(request.headers.get("content-length"), max_bytes, limit_name)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes, limit_name)
        chunks.append(chunk)
    return parse_json_object(b"".join(chunks))


def check_json_content_type(content_type: str | None) -> None:
    """415 unless the body is declared ``application/json``.

    A web page may send a text/plain, form or untyped body to any address without a CORS
    preflight, so such a body could come from any page the user has open; a JSON one cannot.
    """
    if content_type is not None:
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type == "application/json":
            return
    raise OpenAIError(
        415,
        "Send the request body as JSON with the header 'Content-Type: application/json' "
        "(curl: -H 'Content-Type: application/json').",
        code="unsupported_media_type",
    )


def check_declared_length(
    declared: str | None, max_bytes: int, limit_name: str = "--max-body-bytes"
) -> None:
    """413 now for a Content-Length past ``max_bytes``, before a byte of the body is read."""
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes, limit_name)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise OpenAIError(
            400, "The request body is empty; send a JSON object.", code="invalid_json"
        )
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise OpenAIError(
            400, f"The request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "The request body must be a JSON object.", code="invalid_json")
    return body


def too_large(max_bytes: int, limit_name: str = "--max-body-bytes") -> OpenAIError:
    return OpenAIError(
        413,
        f"The request body is larger than {max_bytes} bytes ({limit_name}).",
        code="request_too_large",
    )
