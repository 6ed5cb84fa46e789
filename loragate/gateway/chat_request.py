"""Checking a chat request and bringing it to OpenAI's shape before it reaches a backend.

Two shapes arrive on /v1/chat/completions: OpenAI's (``messages``) and Datature Vi's flat one
(``source`` + ``user_prompt``, optional ``system_prompt`` and ``generation_config``). A Vi
request becomes one user message with the image part first and the text part second.
"""

from __future__ import annotations

import asyncio
from typing import Any

from loragate.gateway.errors import OpenAIError
from loragate.gateway.media import MediaPolicy
from loragate.settings import Settings

VI_FIELDS = ("source", "user_prompt", "system_prompt", "generation_config")
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

# Vi's generation_config uses Hugging Face names; these map onto OpenAI/vLLM parameters.
_HF_TO_OPENAI = {
    "max_new_tokens": "max_tokens",
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "seed": "seed",
    "stop": "stop",
    "stop_strings": "stop",
    "num_return_sequences": "n",
}


def _bad(message: str, param: str | None = None, code: str = "invalid_request") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


async def normalize_chat_request(payload: dict[str, Any], settings: Settings) -> dict[str, Any]:
    has_messages = "messages" in payload
    has_vi = "source" in payload or "user_prompt" in payload
    if has_messages and has_vi:
        raise _bad(
            "Send either OpenAI 'messages' or the Vi fields 'source' and 'user_prompt', not both.",
            code="ambiguous_request_format",
        )
    if not has_messages and not has_vi:
        raise _bad(
            "The request has no 'messages' (OpenAI format) and no 'source' + 'user_prompt' "
            "(Vi format); send one of them.",
            param="messages",
            code="missing_messages",
        )
    media = MediaPolicy(settings.allowed_media_dir, settings.max_image_bytes, settings.max_image_pixels)
    if has_vi:
        payload = _from_vi(payload)
    _translate_guided_json(payload)
    await _check_messages(payload["messages"], media, settings.max_messages)
    _check_response_format(payload.get("response_format"))
    return payload


def _from_vi(payload: dict[str, Any]) -> dict[str, Any]:
    source, prompt = payload.get("source"), payload.get("user_prompt")
    if not isinstance(prompt, str):
        raise _bad("Vi requests need 'user_prompt' as a string.", param="user_prompt")
    if source is not None and not isinstance(source, str):
        raise _bad("Vi 'source' must be a string: a local path, an http(s) URL or a data URI.", param="source")
    system = payload.get("system_prompt")
    if system is not None and not isinstance(system, str):
        raise _bad("Vi 'system_prompt' must be a string.", param="system_prompt")
    content: list[dict[str, Any]] = []
    if source:
        content.append({"type": "image_url", "image_url": {"url": source}})
    content.append({"type": "text", "text": prompt})
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": content})
    out = {key: value for key, value in payload.items() if key not in VI_FIELDS}
    out["messages"] = messages
    config = payload.get("generation_config")
    if config is not None:
        if not isinstance(config, dict):
            raise _bad("Vi 'generation_config' must be an object.", param="generation_config")
        for key, value in _generation_params(config).items():
            out.setdefault(key, value)  # top-level parameters take precedence
    return out


def _generation_params(config: dict[str, Any]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for key, value in config.items():
        target = _HF_TO_OPENAI.get(key)
        if target is not None and value is not None:
            params[target] = value
    if config.get("do_sample") is False:
        params["temperature"] = 0.0  # greedy, as in Hugging Face generate()
    return params


def _translate_guided_json(payload: dict[str, Any]) -> None:
    # vLLM 0.32 ignores the old guided_json silently; clients that still send it get what they meant.
    schema = payload.pop("guided_json", None)
    if schema is not None and "response_format" not in payload:
        payload["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "guided_json", "schema": schema},
        }


async def _check_messages(messages: Any, media: MediaPolicy, max_messages: int) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array.", param="messages")
    if len(messages) > max_messages:
        raise _bad(
            f"'messages' has {len(messages)} entries; this gateway allows {max_messages} (--max-messages).",
            param="messages",
            code="too_many_messages",
        )
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise _bad(f"{where} must be an object.", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise _bad(
                f"{where}.role is {role!r}; use one of {', '.join(sorted(ROLES))}.",
                param=f"{where}.role",
                code="invalid_role",
            )
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise _bad(f"{where}.content must be a string or an array of parts.", param=f"{where}.content")
        for part_index, part in enumerate(content):
            await _check_part(part, f"{where}.content[{part_index}]", media)


async def _check_part(part: Any, where: str, media: MediaPolicy) -> None:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise _bad(f"{where} must be an object with a 'type'.", param=where)
    if part["type"] == "text":
        if not isinstance(part.get("text"), str):
            raise _bad(f"{where}.text must be a string.", param=f"{where}.text")
    elif part["type"] == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str):
            raise _bad(f"{where}.image_url.url must be a string.", param=f"{where}.image_url")
        # File reads and image decoding stay off the event loop.
        resolved = await asyncio.to_thread(media.image_url, url, f"{where}.image_url")
        part["image_url"] = {**(image if isinstance(image, dict) else {}), "url": resolved}


def _check_response_format(response_format: Any) -> None:
    if response_format is None:
        return
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise _bad("'response_format' must be an object with a 'type'.", param="response_format")
    kind = response_format["type"]
    if kind in ("text", "json_object"):
        return
    if kind != "json_schema":
        raise _bad(
            f"'response_format.type' is {kind!r}; use text, json_object or json_schema.",
            param="response_format.type",
        )
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise _bad(
            "'response_format.json_schema.schema' must be a JSON Schema object.",
            param="response_format.json_schema.schema",
            code="invalid_json_schema",
        )
    from jsonschema import exceptions, validators

    try:
        validators.validator_for(schema).check_schema(schema)
    except exceptions.SchemaError as exc:
        raise _bad(
            f"'response_format.json_schema.schema' is not a valid JSON Schema: {exc.message}",
            param="response_format.json_schema.schema",
            code="invalid_json_schema",
        ) from None
