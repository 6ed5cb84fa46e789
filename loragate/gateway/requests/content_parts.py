"""Content parts, checked: text as it is, every image through the media policy and on with a
data URI (an Anthropic image block's ``source`` as base64), no URL the engine would fetch. ``check_part`` takes one part of a chat message (and
brings it to OpenAI's ``image_url`` shape); ``check_body_media`` walks any other body the
gateway forwards, whatever the route and wherever the parts sit, and checks them in place."""

from __future__ import annotations

from typing import Any

from loragate.gateway.errors import OpenAIError
from loragate.gateway.requests.body import Key, containers, json_path
from loragate.gateway.requests.images.limits import ImageBudget
from loragate.gateway.requests.images.resolve import MediaPolicy, media_policy_of
from loragate.settings import Settings

# Part types whose image the gateway checks and sends on as an image_url data URI.
IMAGE_PART_TYPES = frozenset({"image_url", "image", "input_image"})
# Part types the engine reads as text only.
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking"})
# Fields the engine fetches a URL from, whatever the part's type says (vLLM looks a part up by
# these keys when it has a "uuid"); a part may carry only its own, checked one.
URL_FIELDS = ("image_url", "audio_url", "video_url")
_OWN_URL_FIELD = {
    "image_url": "image_url",
    "input_image": "image_url",
    "audio_url": "audio_url",
    "video_url": "video_url",
}


def _bad(message: str, param: str, code: str = "invalid_request") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def is_image_type(kind: object) -> bool:
    return isinstance(kind, str) and kind in IMAGE_PART_TYPES  # a list would be unhashable


def plain_text(part: Any) -> bool:
    """A text part that ``check_part`` would give back as it is (most parts are)."""
    if type(part) is not dict:
        return False
    kind = part.get("type")
    if type(kind) is not str or kind not in TEXT_PART_TYPES:
        return False
    if kind == "text" and not isinstance(part.get("text"), str):
        return False
    return not any(key in part for key in URL_FIELDS)


async def check_part(part: Any, where: str, media: MediaPolicy, budget: ImageBudget) -> Any:
    """``part`` as the engine gets it (images as checked data URIs); 4xx naming ``where``."""
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise _bad(f"{where} must be an object with a 'type'.", param=where)
    kind = part["type"]
    stray = [key for key in URL_FIELDS if key in part and key != _OWN_URL_FIELD.get(kind)]
    if stray:
        raise _bad(
            f"{where} is a {kind!r} part but carries {stray[0]!r}; send each image as its own "
            "image_url part.",
            param=f"{where}.{stray[0]}",
            code="unsupported_content_part",
        )
    if kind in TEXT_PART_TYPES:
        if kind == "text" and not isinstance(part.get("text"), str):
            raise _bad(f"{where}.text must be a string.", param=f"{where}.text")
        return part
    if kind == "image":
        # The Vi SDK's own part, {"type": "image", "image": "<path or URL>"}: OpenAI's from here on.
        checked = await media.image(part.get("image"), f"{where}.image", budget)
        return {"type": "image_url", "image_url": {"url": checked}}
    if kind == "input_image":
        # The Responses API's part, {"type": "input_image", "image_url": "<URL>"}: the same.
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        checked = await media.image(url, f"{where}.image_url", budget)
        return {"type": "image_url", "image_url": {"url": checked}}
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        resolved = await media.image(url, f"{where}.image_url.url", budget)
        return {
            **part,
            "image_url": {**(image if isinstance(image, dict) else {}), "url": resolved},
        }
    if kind in ("audio_url", "video_url"):
        field = part.get(kind)
        url = field.get("url") if isinstance(field, dict) else field
        if not isinstance(url, str) or url[:5].lower() != "data:":
            medium = kind.removesuffix("_url")
            raise _bad(
                f"{where} is a {kind!r} part with a URL the engine would fetch; this gateway "
                f"lets the engine fetch nothing: send the {medium} as a data: URI.",
                param=f"{where}.{kind}",
                code="unsupported_content_part",
            )
        return part  # inline data: nothing to fetch, the engine decodes it
    return part  # other kinds carry no URL (input_audio holds its data): the engine decides


# ----- every other JSON body: the same policy, wherever in the body a part sits ---------------

# Fields the engine fetches media from: wherever they sit, the gateway checks them first.
FETCHED_FIELDS = ("image_url", "audio_url", "video_url", "file_url")
_INLINE_ONLY = ("audio_url", "video_url", "file_url")  # the gateway fetches images alone


def _url_of(value: object) -> str | None:
    """The URL a media field holds (``"<url>"`` or ``{"url": "<url>"}``), else None."""
    if isinstance(value, dict):
        value = value.get("url")
    return value if isinstance(value, str) else None


def _is_media_part(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    if is_image_type(kind) or kind in _INLINE_ONLY or kind == "input_file":
        return True
    return any(_url_of(node.get(field)) is not None for field in FETCHED_FIELDS)


def media_parts(body: Any) -> list[tuple[dict[str, Any], tuple[Key, ...]]]:
    """Every object in ``body`` the engine would read media from, with the keys that lead to
    it (``json_path`` makes them a name), in the body's order. A step per object or array
    (``body.containers``; the body's shape was capped when it was parsed)."""
    return [
        (node, tuple(keys))
        for node, keys in containers(body)
        if type(node) is dict and _is_media_part(node)
    ]


async def check_body_media(
    body: dict[str, Any], media: MediaPolicy, budget: ImageBudget, max_images: int
) -> None:
    """Check every media reference in ``body``, whatever the route and however deep, in place:
    each image becomes the checked data URI (fetched, read or decoded by the gateway, the
    chat route's policy and budgets), in the shape it came in; audio, video and files must be
    inline already. 4xx naming the field; nothing is fetched when the count is over."""
    parts = media_parts(body)
    images = [keys for part, keys in parts if is_image_type(part.get("type"))] + [
        keys
        for part, keys in parts
        if not is_image_type(part.get("type")) and _url_of(part.get("image_url")) is not None
    ]
    if len(images) > max_images:
        raise _bad(
            f"The request has {len(images)} images; this gateway allows {max_images} per request "
            "(max_images_per_request).",
            param=json_path(images[0][:1]),
            code="too_many_images",
        )
    for part, keys in parts:
        await _check_in_place(part, json_path(keys), media, budget)


async def _check_in_place(
    part: dict[str, Any], where: str, media: MediaPolicy, budget: ImageBudget
) -> None:
    kind = part.get("type")
    if kind == "input_file":
        raise _bad(
            f"{where} is an input_file part; this gateway does not pass files to the engine. "
            "Send text as input_text and images as input_image.",
            param=where,
            code="unsupported_content_part",
        )
    if kind == "input_image" and part.get("file_id") is not None:
        raise _bad(
            f"{where} names an image by file_id; this gateway has no file store: send the "
            "image as image_url (a data: URI, an http(s) URL or a file in --allowed-media-dir).",
            param=f"{where}.file_id",
            code="unsupported_content_part",
        )
    if kind == "image" and "source" in part and "image" not in part:
        part["source"] = await _checked_anthropic_source(part["source"], where, media, budget)
        return
    field = "image" if kind == "image" else "image_url"
    value = part.get(field)
    if is_image_type(kind) or _url_of(value) is not None:
        if isinstance(value, dict):
            checked = await media.image(value.get("url"), f"{where}.{field}.url", budget)
            part[field] = {**value, "url": checked}
        else:
            part[field] = await media.image(value, f"{where}.{field}", budget)
    for field in _INLINE_ONLY:
        if field not in part and kind != field:
            continue
        url = _url_of(part.get(field))
        if kind != field and url is None:
            continue  # a field of that name holding no URL (a JSON Schema's property, say)
        if url is None or url[:5].lower() != "data:":
            raise _bad(
                f"{where} carries {field!r} with a URL the engine would fetch; this gateway "
                "lets the engine fetch nothing: send images as image parts, other media as "
                "data: URIs.",
                param=f"{where}.{field}",
                code="unsupported_content_part",
            )


async def _checked_anthropic_source(
    source: object, where: str, media: MediaPolicy, budget: ImageBudget
) -> dict[str, str]:
    """An Anthropic image block's ``source`` (``{"type": "url", "url"}`` or ``{"type":
    "base64", "media_type", "data"}``) through the image policy, as a base64 source: vLLM's
    ``/v1/messages`` would fetch a URL source itself."""
    param = f"{where}.source"
    kind = source.get("type") if isinstance(source, dict) else None
    if not isinstance(source, dict) or kind not in ("url", "base64"):
        raise _bad(
            f"{param} must be an image source of type 'url' or 'base64'; this gateway has no "
            "file store for other kinds.",
            param=param,
            code="unsupported_content_part",
        )
    if kind == "url":
        url = source.get("url")
    else:
        url = f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"
    checked = await media.image(url, f"{param}.{'url' if kind == 'url' else 'data'}", budget)
    header, _, data = checked.partition(",")
    return {"type": "base64", "media_type": header[5:].split(";", 1)[0], "data": data}


async def check_forwarded_media(body: dict[str, Any], settings: Settings) -> None:
    """The chat route's image policy and budgets for any other JSON body the gateway forwards
    (embeddings, pooling, scores, rerank, tokenize, Responses ...): ``check_body_media``."""
    await check_body_media(
        body,
        media_policy_of(settings),
        ImageBudget(settings.max_body_bytes),
        settings.max_images_per_request,
    )
