"""One content part of a chat message, checked: text as it is, every image through the media
policy and on as an OpenAI ``image_url`` part with a data URI, no URL the engine would fetch."""

from __future__ import annotations

from typing import Any

from loragate.gateway.errors import OpenAIError
from loragate.gateway.requests.image_limits import ImageBudget
from loragate.gateway.requests.media import MediaPolicy

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
