"""Checking a chat request and bringing it to OpenAI's shape before it reaches a backend.

Two shapes arrive on /v1/chat/completions: OpenAI's (``messages``) and Datature Vi's flat one
(``source`` + ``user_prompt``, see ``vi``). The result remembers the Vi request it came from
(``ChatRequest.vi``), so a backend that has its own Vi entry point
(``InferenceBackend.generate_vi_format``) still gets it. The body sent to an engine is the
OpenAI body alone.

Everything a client can get wrong is answered here with a 400 that says what to send
instead: roles, content parts and images (``content_parts``, ``media``), the response
format's JSON Schema (``structured_outputs``), Vi's generation config.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import compress, repeat
from typing import Any

from loragate.gateway.errors import OpenAIError
from loragate.gateway.requests.content_parts import check_part, is_image_type, plain_text
from loragate.gateway.requests.images.limits import ImageBudget
from loragate.gateway.requests.images.resolve import MediaPolicy, media_policy_of
from loragate.gateway.requests.images.vision_model import model_takes_images, model_takes_video
from loragate.gateway.requests.structured_outputs import (
    check_response_format,
    check_structured_outputs,
    translate_guided,
)
from loragate.gateway.requests.vi import (
    VI_KEYS,
    ViRequest,
    generation_params,
    vi_request,
    vi_to_messages,
)
from loragate.settings import Settings

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

IMAGE_HELP = (
    'Send the image as an image_url content part, e.g. {"role": "user", "content": '
    '[{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}, '
    '{"type": "text", "text": "What is in this image?"}]}, or in the Vi format as '
    '{"source": "<local path, http(s) URL or data URI>", "user_prompt": "..."}.'
)


class ChatRequest(dict[str, Any]):
    """An OpenAI chat request body, checked; ``vi`` is the Vi request it came from, if any.

    A plain dict to everything that sends it on (``orjson`` writes it as the OpenAI body);
    backends with a Vi entry point read ``vi``; ``sent`` is the body as the client sent it,
    from which a backend written for the Vi SDK's server gets its ``generation_config`` built
    as that server builds it (``custom_parameters.vi_generation_config``).
    """

    def __init__(
        self, body: dict[str, Any], vi: ViRequest | None = None, sent: dict[str, Any] | None = None
    ) -> None:
        super().__init__(body)
        self.vi = vi
        self.sent = sent if sent is not None else body


def _bad(message: str, param: str | None = None, code: str = "invalid_request") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def _given(payload: dict[str, Any], key: str) -> bool:
    # Clients that build requests from typed models send absent fields as null.
    return payload.get(key) is not None


async def normalize_chat_request(payload: dict[str, Any], settings: Settings) -> ChatRequest:
    """Check ``payload`` and return it in OpenAI's shape; raises ``OpenAIError`` (400) when bad."""
    has_vi = _given(payload, "source") or _given(payload, "user_prompt")
    # messages=[] beside Vi fields is how the OpenAI SDK (which needs `messages`) sends a Vi request.
    has_messages = _given(payload, "messages") and not (has_vi and payload["messages"] == [])
    if has_messages and (has_vi or _given(payload, "system_prompt")):
        raise _bad(
            "Send either OpenAI 'messages' or the Vi fields 'source' and 'user_prompt' "
            "(with an optional 'system_prompt'), not both.",
            code="ambiguous_request_format",
        )
    if not has_messages and not has_vi:
        raise _bad(
            "The request has no 'messages' (OpenAI format) and no 'source' + 'user_prompt' "
            "(Vi format); send one of them.",
            param="messages",
            code="missing_messages",
        )
    body = {key: value for key, value in payload.items() if key not in VI_KEYS or value is not None}
    config = body.pop("generation_config", None)
    if config is not None:
        for key, value in generation_params(config).items():
            if body.get(key) is None:  # top-level parameters take precedence
                body[key] = value
    if has_vi:
        vi_to_messages(body)
    translate_guided(body)
    budget = ImageBudget(settings.max_body_bytes)
    if has_vi:
        await _check_vi_video(body["messages"], settings, budget)
    else:
        _refuse_video_parts(body["messages"], settings)
    try:
        await _check_messages(
            body["messages"],
            media_policy_of(settings),
            settings.max_messages,
            settings.max_images_per_request,
            budget,
        )
    except OpenAIError as exc:
        if has_vi and exc.param and exc.param.endswith(".image_url.url"):
            exc.param = "source"  # the field the Vi client sent
        raise
    if model_takes_images(settings):
        _require_image(body["messages"], vi=has_vi)
    check_response_format(body.get("response_format"))
    check_structured_outputs(body.get("structured_outputs"))
    vi = vi_request(payload, body["messages"]) if has_vi else None
    return ChatRequest(body, vi, sent=payload)


async def _check_vi_video(
    messages: list[dict[str, Any]], settings: Settings, budget: ImageBudget
) -> None:
    """A Vi ``source`` naming a video (``vi_messages`` made it a ``video_url`` part): a 400 when
    the model's config has no video input; else read and checked as images are, and sent on
    as a data URI."""
    part = messages[-1]["content"][0] if messages[-1]["content"] else None
    if part is None or part["type"] != "video_url":
        return
    if model_takes_video(settings) is False:
        raise _bad(
            f"The Vi 'source' is a video, but {settings.model} takes no video (its config.json "
            "names no video input). Send an image, or serve a video model such as Cosmos "
            "Reason2 (Vi's video-freeform task).",
            param="source",
            code="video_unsupported",
        )
    part["video_url"]["url"] = await media_policy_of(settings).video(
        part["video_url"]["url"], "source", budget
    )


def _refuse_video_parts(messages: Any, settings: Settings) -> None:
    """OpenAI's ``video_url`` parts: a 400 naming the first when the model's config has no
    video input (as for a Vi video ``source``), before the engine is asked."""
    if not isinstance(messages, list):
        return  # _check_messages says what is wrong with it
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for at, part in _objects_in(content):
            if part.get("type") == "video_url":
                if model_takes_video(settings) is not False:
                    return
                raise _bad(
                    f"messages[{index}].content[{at}] is a video, but {settings.model} takes no "
                    "video (its config.json names no video input). Send images, or serve a "
                    "video model.",
                    param=f"messages[{index}].content[{at}]",
                    code="video_unsupported",
                )


async def _check_messages(
    messages: Any, media: MediaPolicy, max_messages: int, max_images: int, budget: ImageBudget
) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array.", param="messages")
    if len(messages) > max_messages:
        raise _bad(
            f"'messages' has {len(messages)} entries; this gateway allows {max_messages} (--max-messages).",
            param="messages",
            code="too_many_messages",
        )
    images = 0
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise _bad(f"{where} must be an object.", param=where)
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:  # a list or object is unhashable
            raise _bad(
                f"{where}.role is {role!r}; use one of {', '.join(sorted(ROLES))}.",
                param=f"{where}.role",
                code="invalid_role",
            )
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise _bad(
                f"{where}.content must be a string or an array of parts.", param=f"{where}.content"
            )
        images += sum(1 for _, part in _objects_in(content) if is_image_type(part.get("type")))
    # Counted before any image is read, fetched or decoded.
    if images > max_images:
        raise _bad(
            f"The request has {images} images; this gateway allows {max_images} per request "
            "(max_images_per_request).",
            param="messages",
            code="too_many_images",
        )
    for index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for i, part in enumerate(content):
            if not plain_text(part):  # most parts: checked without a name made for them
                where = f"messages[{index}].content[{i}]"
                content[i] = await check_part(part, where, media, budget)


def _objects_in(content: list[Any]) -> Iterator[tuple[int, dict[str, Any]]]:
    """The objects among ``content``'s parts, with their indexes; the others passed over
    inside C (``compress``), not a Python step each."""
    return compress(enumerate(content), map(isinstance, content, repeat(dict)))


def _has_image(messages: list[dict[str, Any]]) -> bool:
    return any(
        isinstance(message.get("content"), list)
        and any(part.get("type") in ("image_url", "video_url") for part in message["content"])
        for message in messages
    )


def _require_image(messages: list[dict[str, Any]], vi: bool) -> None:
    """A vision model asked in plain text, without any image: say how to send one.

    A request whose user turns are lists of text parts asks without an image on purpose
    and goes through.
    """
    if _has_image(messages):
        return
    user_contents = [m.get("content") for m in messages if m.get("role") == "user"]
    if not vi and not all(isinstance(content, str) for content in user_contents):
        return
    raise _bad(
        "This model takes an image, but the request has none. "
        + IMAGE_HELP
        + (
            ""
            if vi
            else " To ask without an image on purpose, send the content as a list of text parts."
        ),
        param="source" if vi else "messages",
        code="image_required",
    )
