"""What one request, and all of them at once, may take: the queue, body and message sizes,
max_tokens, and the images a chat request carries (including which URLs it may name)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from loragate.settings.serve_option import serve_option


class RequestLimitFields(BaseModel):
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
