"""What one request, and all of them at once, may take: the queue, the requests answered at
once, the deadlines and header budget of a connection, body and message sizes, max_tokens, and
the images a chat request carries (including which URLs it may name)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from loragate.settings.serve_option import serve_option

# The default of max_answer_bytes, and of the proxy that a backend builds without settings.
MAX_ANSWER_BYTES = 64 * 1024 * 1024


class RequestLimitFields(BaseModel):
    queue_size: int = Field(
        default=256,
        ge=0,
        description=(
            "Requests that may wait while the engine starts or restarts; past it, a 503 with "
            "Retry-After."
        ),
    )
    queue_deadline: float = Field(
        default=300.0,
        ge=0,
        description="Seconds a request may wait for the engine (or its adapter) before a 503.",
    )
    max_body_bytes: int = Field(
        default=32 * 1024 * 1024,
        gt=0,
        description="Largest request body in bytes, 413 above.",
        json_schema_extra=serve_option(),
    )
    max_answer_bytes: int = Field(
        default=MAX_ANSWER_BYTES,
        ge=64 * 1024,
        description=(
            "Largest answer, in bytes, the gateway takes whole from the engine (or "
            "--upstream-url server): a non-streamed answer, or one event of a stream (the "
            "Responses API's last event holds the whole answer). Past it, a 502 "
            "engine_answer_too_large (mid-stream, an error event) and the connection cut. "
            "Raise it for embeddings of large batches sent as JSON floats."
        ),
        json_schema_extra=serve_option(),
    )
    limit_concurrency: int = Field(
        default=512,
        ge=1,
        description=(
            "Most requests being answered at once; past it, a 503 at once (GET /health/live "
            "and /health are always answered). Idle connections do not count: the deadlines "
            "below close them."
        ),
        json_schema_extra=serve_option(),
    )
    header_timeout: float = Field(
        default=10.0,
        gt=0,
        description=(
            "Seconds a client has to send a request's line and headers, counted from connecting "
            "(or, on a kept-alive connection, from the request's first byte); then a 408 and a "
            "close (a quiet close if it sent nothing)."
        ),
        json_schema_extra=serve_option(),
    )
    body_timeout: float = Field(
        default=30.0,
        gt=0,
        description=(
            "Seconds a request body may go without a byte arriving while the gateway reads it; "
            "then the connection is closed."
        ),
        json_schema_extra=serve_option(),
    )
    body_deadline: float = Field(
        default=120.0,
        gt=0,
        description=(
            "Seconds a request body may take in all, from the end of its headers to its last "
            "byte, however steadily it arrives (time the gateway spends not reading is not "
            "counted); then a 408 and a close. Bounds how long a body sent a byte at a time "
            "holds a --limit-concurrency slot."
        ),
        json_schema_extra=serve_option(),
    )
    write_timeout: float = Field(
        default=60.0,
        gt=0,
        description=(
            "Seconds a client may leave its answer unread (the connection's send buffer full); "
            "then the connection is closed and its engine request stopped."
        ),
        json_schema_extra=serve_option(),
    )
    max_header_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        description="Largest request line plus headers, in bytes; past it, a 431 and a close.",
        json_schema_extra=serve_option(),
    )
    max_headers: int = Field(
        default=100,
        ge=1,
        description="Most headers in one request; past it, a 431 and a close.",
        json_schema_extra=serve_option(),
    )
    max_connections_per_peer: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Most connections open at once from one client address; more are closed at once. "
            "Default: no cap. Leave it off behind a proxy or NAT that many clients share."
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
        description=(
            "Most tokens one request may have generated, on every generation route: a "
            "max_tokens, max_completion_tokens, min_tokens (Vi: max_new_tokens, "
            "min_new_tokens) or Responses max_output_tokens above it is a 400, and a request "
            "that names no limit gets this one (a completion keeps vLLM's 16 when lower). "
            "Default: no cap."
        ),
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
