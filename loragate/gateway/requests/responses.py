"""Checks on a Responses API request (``POST /v1/responses``) before it reaches the engine.

The engine fetches any image URL it is given. Chat requests have their images checked by the
gateway (``media``: --allowed-media-dir, private addresses refused, sizes capped) and sent on
as data URIs; ``input_image`` parts here get exactly the same treatment, so the new route is
no way around that policy. What the gateway cannot check is refused with a 400 that says what
to send instead: images by ``file_id`` (no file store behind this gateway), ``input_file``
parts, media URLs in other parts, and ``mcp`` tools (the engine would connect to the
``server_url`` a client names).
"""

from __future__ import annotations

from typing import Any

from loragate.gateway.errors import OpenAIError
from loragate.gateway.requests.image_limits import ImageBudget
from loragate.gateway.requests.media import MediaPolicy, media_policy_of
from loragate.settings import Settings

_MEDIA_URL_FIELDS = ("image_url", "audio_url", "video_url", "file_url")


def _bad(message: str, param: str, code: str = "unsupported_content_part") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


async def check_responses_request(payload: dict[str, Any], settings: Settings) -> None:
    """Check ``payload`` in place: images become checked data URIs, limits apply; 4xx if bad."""
    cap = settings.max_tokens_cap
    limit = payload.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise _bad(
                "'max_output_tokens' must be a positive integer",
                "max_output_tokens",
                "invalid_value",
            )
        if cap is not None and limit > cap:
            raise _bad(
                f"'max_output_tokens' is {limit}, above this gateway's cap of {cap} "
                "(--max-tokens-cap)",
                "max_output_tokens",
                "max_tokens_too_large",
            )
    _check_tools(payload.get("tools"))
    parts = list(_parts(payload.get("input")))
    images = sum(1 for part, _ in parts if part.get("type") == "input_image")
    if images > settings.max_images_per_request:
        raise _bad(
            f"The request has {images} images; this gateway allows "
            f"{settings.max_images_per_request} per request (max_images_per_request).",
            "input",
            "too_many_images",
        )
    media = media_policy_of(settings)
    budget = ImageBudget(settings.max_body_bytes)
    for part, where in parts:
        await _check_part(part, where, media, budget)


def _parts(items: Any) -> list[tuple[dict[str, Any], str]]:
    """Every content part of ``input`` (items with ``content`` arrays, and bare parts)."""
    if not isinstance(items, list):
        return []  # a plain string, or something the engine will refuse itself
    found: list[tuple[dict[str, Any], str]] = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        where = f"input[{index}]"
        content = item.get("content")
        if isinstance(content, list):
            found += [
                (part, f"{where}.content[{i}]")
                for i, part in enumerate(content)
                if isinstance(part, dict)
            ]
        else:
            found.append((item, where))
    return found


async def _check_part(
    part: dict[str, Any], where: str, media: MediaPolicy, budget: ImageBudget
) -> None:
    kind = part.get("type")
    if kind == "input_image":
        if part.get("file_id") is not None:
            raise _bad(
                f"{where} names an image by file_id; this gateway has no file store: send the "
                "image as image_url (a data: URI, an http(s) URL or a file in "
                "--allowed-media-dir).",
                f"{where}.file_id",
            )
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        part["image_url"] = await media.image(url, f"{where}.image_url", budget)
        return
    if kind == "input_file":
        raise _bad(
            f"{where} is an input_file part; this gateway does not pass files to the engine. "
            "Send text as input_text and images as input_image.",
            where,
        )
    for field in _MEDIA_URL_FIELDS:
        value = part.get(field)
        url = value.get("url") if isinstance(value, dict) else value
        if value is not None and not (isinstance(url, str) and url[:5].lower() == "data:"):
            raise _bad(
                f"{where} carries {field!r} with a URL the engine would fetch; this gateway lets "
                "the engine fetch nothing: send images as input_image parts, other media as "
                "data: URIs.",
                f"{where}.{field}",
            )


def _check_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        return
    for index, tool in enumerate(tools):
        if isinstance(tool, dict) and tool.get("type") == "mcp":
            raise _bad(
                f"tools[{index}] is an mcp tool: the engine would connect to the server it "
                "names, which this gateway does not allow. Use function tools.",
                f"tools[{index}]",
                "unsupported_tool",
            )
