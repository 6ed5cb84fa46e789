"""Every way loragate answers differently from the Vi SDK's server, each with its reason.

The one place the reasons live: docs/vi-sdk.md's difference table is written from these rows
and from what the side-by-side run observed (``run.render_table``). A row's ``explain``
(``recognise``) finds its difference in one case's observations and settles it; a case
still apart once every row had its turn is a difference the table does not list, and a row
no case needed is a false row: the test fails on either.
"""

from __future__ import annotations

from dataclasses import dataclass

from loragate.gateway.requests.parameters import MAX_N
from tests.vi_side_by_side import recognise
from tests.vi_side_by_side.recognise import Explain


@dataclass(frozen=True)
class Difference:
    key: str
    vi: str
    loragate: str
    reason: str
    explain: Explain


DIFFERENCES = [
    Difference(
        "security-headers",
        "none",
        "`X-Content-Type-Options: nosniff`, `X-Frame-Options: DENY`, `Referrer-Policy: "
        "no-referrer` on every answer; its HTML pages a `Content-Security-Policy`",
        "a gateway reachable from browsers says so once, for every route",
        recognise.security_headers,
    ),
    Difference(
        "request-id",
        "none",
        "`X-Request-ID` on every answer to a generation request, the gateway's refusals "
        "included: the client's own, else a new one",
        "one id ties a client's request to the gateway's log line, trace and metrics",
        recognise.request_id,
    ),
    Difference(
        "stream-headers",
        "`text/event-stream` only",
        "also `Cache-Control: no-cache` and `X-Accel-Buffering: no`",
        "proxies (nginx) would otherwise buffer the stream and deliver it at the end",
        recognise.stream_headers,
    ),
    Difference(
        "null-fields",
        "every field of the OpenAI SDK's `ChatCompletion`, null ones included (`refusal`, "
        "`audio`, `tool_calls`, `system_fingerprint`, `usage.*_details`, ...)",
        "null fields left out (`logprobs: null` kept)",
        "OpenAI's clients read an absent field as null; the gateway sends what it knows",
        recognise.null_fields,
    ),
    Difference(
        "stream-role-delta",
        "content deltas from the first chunk",
        'a first chunk with `delta: {"role": "assistant", "content": ""}`',
        "OpenAI's stream opens so; clients that build the message from the deltas need the role",
        recognise.role_delta,
    ),
    Difference(
        "stream-logprobs",
        "chunks' choices carry no `logprobs`",
        "`logprobs: null` in each chunk's choice",
        "OpenAI's chunk shape, the same as the whole answer's choices",
        recognise.chunk_logprobs,
    ),
    Difference(
        "stop",
        "`stop` handed to the backend, the answer as it returned it",
        "also cut at the first stop string; streamed, up to a stop string's length less one "
        "character is held back until it cannot start one (the joined text is the same)",
        "OpenAI's meaning of `stop`, whether or not the backend honours it",
        recognise.stop,
    ),
    Difference(
        "n",
        "`n` ignored: one choice, whatever its value",
        f"`n` choices, the backend asked `n` times; outside 1 to {MAX_N}: 400",
        "OpenAI's meaning of `n`; an `n` that asks for nothing or for hundreds is a mistake",
        recognise.n_choices,
    ),
    Difference(
        "include-usage",
        "`stream_options` ignored",
        "`stream_options.include_usage`: `usage: null` in each chunk, then a last chunk with "
        "the counts",
        "OpenAI's streamed usage, which clients and proxies count tokens with",
        recognise.include_usage,
    ),
    Difference(
        "usage-counted",
        "`usage` as the backend reported it, zeros included",
        "a backend's zero counts replaced by `count_tokens()` (words, unless overridden)",
        "a usage of 0 tokens would make metering and rate limits count nothing",
        recognise.usage_counted,
    ),
    Difference(
        "stream-error-before-output",
        "a streamed request whose backend raises before any output: 200, then one SSE event "
        '`{"error": {"message", "type"}}` and no `[DONE]`',
        "the status it deserves: 400 for `ValueError`, else 500, as JSON",
        "nothing was sent yet, so the client can be told with a status instead of a 200",
        recognise.error_before_output,
    ),
    Difference(
        "stream-error-midway",
        'a backend that raises after some output: an SSE event `{"error": {"message", '
        '"type": "ValueError"}}`, then nothing',
        "an SSE event in OpenAI's error shape, then `[DONE]`",
        "OpenAI's clients wait for `[DONE]`; the error names its type the same way as elsewhere",
        recognise.error_midway,
    ),
    Difference(
        "value-error",
        "a backend's `ValueError`: 500",
        "400 with its message",
        "Vi backends raise `ValueError` for a bad request (`vi/deployment/local/utils.py`)",
        recognise.value_error,
    ),
    Difference(
        "models-listing-fails",
        "`GET /v1/models` with a backend whose `available_models()` raises: plain-text "
        "`Internal Server Error`",
        "500 as JSON, naming the failure",
        "every answer is JSON; a plain-text 500 is the ASGI server's, not an answer",
        recognise.listing_fails,
    ),
    Difference(
        "schema-refusal",
        "422 for a field its Pydantic schema refuses (out of range, wrong type, an unknown "
        "role, `content: null`, no `model`)",
        "400 naming the same field; the backend is not asked either",
        "a bad request is a 400 in OpenAI's API",
        recognise.schema_refusal,
    ),
    Difference(
        "not-a-json-object",
        "422 for a body that is not a JSON object (malformed, empty, an array, `null`)",
        "400 `invalid_json`",
        "a bad request is a 400 in OpenAI's API",
        recognise.not_a_json_object,
    ),
    Difference(
        "content-type",
        "422 for a body not declared JSON (no `Content-Type`, `text/plain`, a form)",
        "415 `unsupported_media_type`",
        "a web page can send those cross-origin without a preflight; JSON it cannot",
        recognise.content_type,
    ),
    Difference(
        "error-shape",
        "`{\"detail\": ...}` (FastAPI's: a string, or Pydantic's list of errors)",
        'OpenAI\'s `{"error": {"message", "type", "param", "code"}}`',
        "the shape OpenAI's clients raise as a typed error; `param` names the field",
        recognise.error_shape,
    ),
    Difference(
        "loose-types",
        'values Pydantic coerces taken: `"0.5"`, `true` for a number, `5.0` or `"5"` '
        'for an integer, `"true"`, `"yes"` or `1` for `stream`',
        "400 naming the field",
        "OpenAI's API takes JSON's types; a string where a number goes is a client's bug",
        recognise.loose_types,
    ),
    Difference(
        "own-bounds",
        "`top_p: 0`, `repetition_penalty: 0` (its bound is `ge=0`), penalties beyond ±2 taken",
        "400 naming the field: `top_p` and `repetition_penalty` must be above 0, the two "
        "OpenAI penalties within -2 to 2",
        "the engine refuses these values; the gateway says so before a backend is asked",
        recognise.own_bounds,
    ),
    Difference(
        "system-prompt",
        "`system_prompt` beside `source` dropped silently",
        "400: a Vi SDK backend's `generate_vi_format` takes none (loragate's own backends are "
        "served it)",
        "dropping an instruction silently answers a different request",
        recognise.system_prompt,
    ),
    Difference(
        "not-supported",
        "`tools`, `functions`, `logprobs: true`, `top_logprobs` ignored",
        "400 `not_supported` naming the field",
        "a backend that never sees them cannot honour them; ignoring them answers a different "
        "request than was asked",
        recognise.not_supported,
    ),
    Difference(
        "response-format-checked",
        "a `response_format` of an unknown type, or a `json_schema` without a schema: ignored; "
        "a schema that is not an object: 500",
        "400 naming the field",
        "structured output that is silently dropped answers a different request",
        recognise.response_format_checked,
    ),
    Difference(
        "generation-config-keys",
        "unknown `generation_config` keys handed on",
        "400 naming the supported ones",
        "a misspelt key would otherwise be ignored without a word",
        recognise.generation_config_keys,
    ),
    Difference(
        "media-checked",
        "the image string handed on as sent, whatever it holds",
        "an image that is not one (a corrupt or undecodable data URI, a URL or file that is "
        "not an image, a missing file, a URL that answers 404) or an empty `source`: 400",
        "a backend is handed only images it can open, so a bad one is the client's 400, not a "
        "backend's 500",
        recognise.media_checked,
    ),
    Difference(
        "media-dir",
        "a local path read from anywhere",
        "403 for a path outside `--allowed-media-dir` (unset, the default: every path refused)",
        "any client could otherwise have the server read any file it can",
        recognise.media_dir,
    ),
    Difference(
        "media-as-data-uri",
        "`source` or `image_url` handed to the backend as sent (a path, `file://` or http(s) "
        "URL, raw base64)",
        "always the checked image as a data URI: a local file read, an http(s) URL fetched by "
        "the gateway, raw base64 given its prefix",
        "a backend never fetches a URL or opens a path itself, so it can reach nothing the "
        "gateway would not",
        recognise.media_as_data_uri,
    ),
    Difference(
        "vi-image-part",
        'a `{"type": "image", "image": PATH}` part handed on as sent',
        "read (inside `--allowed-media-dir`) and handed on as an `image_url` data URI part",
        "the same rule as every other image: a backend never opens a path itself",
        recognise.vi_image_part,
    ),
    Difference(
        "image-url-string",
        "an `image_url` given as a bare string handed on as sent",
        'handed on as OpenAI\'s `{"url": ...}` object',
        "a backend reads every image part one way",
        recognise.image_url_string,
    ),
    Difference(
        "guided-json",
        "vLLM's `guided_json` ignored",
        "handed to the backend as `response_format` (a Pydantic model named `guided_json`)",
        "clients written for vLLM ask for structured output this way",
        recognise.guided_json,
    ),
    Difference(
        "foreign-origin",
        "served",
        "403 for a request whose `Origin` is not listed in `--cors-origin` (inference and "
        "model list; health is exempt)",
        "a web page could otherwise use the models on the user's machine",
        recognise.foreign_origin,
    ),
    Difference(
        "foreign-host",
        "served",
        "403 for a `Host` that is not the gateway's (loopback names, `--host`, `--allowed-hosts`)",
        "DNS rebinding: a page whose name resolves to the gateway names itself in `Host`",
        recognise.foreign_host,
    ),
    Difference(
        "health-uptime",
        '`{"status", "models"}`',
        "the same and `uptime_s`",
        "a probe can tell a restarted gateway from one that has been up",
        recognise.uptime,
    ),
    Difference(
        "not-ready",
        '200 `{"status": "unhealthy", "error"}` when the backend lists no models or '
        "cannot list them",
        '503 with `Retry-After` and `{"status", "reason"}`, the status `starting` or `failed`',
        "probes and load balancers read the status code",
        recognise.not_ready,
    ),
    Difference(
        "model-entries",
        '`/v1/models`: `owned_by: "datature"`, `created: null`',
        '`owned_by: "loragate"`, `created` (when the gateway started), `parent: null` (an '
        "adapter names its base model there)",
        "OpenAI's model object; `parent` is how clients tell adapters from base models",
        recognise.model_entries,
    ),
    Difference(
        "model-route",
        "no `GET /v1/models/{id}` (404)",
        "the model's entry (404 `model_not_found` for an unknown one)",
        "OpenAI's API has the route, and its clients' `models.retrieve()` calls it",
        recognise.one_model_route,
    ),
    Difference(
        "metrics",
        "no `/metrics`",
        "Prometheus metrics (with `metrics_public` off: behind the admin key)",
        "requests, latencies and tokens, by model, for the operator",
        recognise.metrics,
    ),
    Difference(
        "api-description",
        "FastAPI's: `/openapi.json` of its four routes, Swagger UI at `/docs`, ReDoc at `/redoc`",
        "`/openapi.json` of its own routes, `/docs` a plain page linking it, no `/redoc`",
        "the gateway's pages load no script from elsewhere",
        recognise.api_description,
    ),
]
