"""Checks on a Responses API request (``POST /v1/responses``) before it reaches the engine.

The engine fetches any image URL it is given. Every forwarded body has its images checked by
the gateway (``content_parts.check_forwarded_media``: --allowed-media-dir, private addresses refused,
sizes capped) and sent on as data URIs, wherever they sit: ``input_image`` parts in input
items, bare, or in a ``function_call_output``'s output. What the gateway cannot check is
refused with a 400 that says what to send instead: images by ``file_id`` (no file store behind
this gateway), ``input_file`` parts, media URLs in other parts, and ``mcp`` tools (the engine
would connect to the ``server_url`` a client names).
"""

from __future__ import annotations

from typing import Any

from loragate.gateway.errors import OpenAIError
from loragate.gateway.requests.content_parts import check_forwarded_media
from loragate.settings import Settings


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
    # Parts sit in input items' content, bare in input, and in a function_call_output's output.
    await check_forwarded_media(payload, settings)


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
