"""Checking a chat request and bringing it to OpenAI's shape before it reaches a backend.

Two shapes arrive on /v1/chat/completions: OpenAI's (``messages``) and Datature Vi's flat one
(``source`` + ``user_prompt``, optional ``system_prompt`` and ``generation_config``). A Vi
request becomes one user message with the image part first and the text part second; the
result remembers the Vi request it came from (``ChatRequest.vi``), so a backend that has its
own Vi entry point (``InferenceBackend.generate_vi_format``) still gets it. The body sent to
an engine is the OpenAI body alone.

Everything a client can get wrong is answered here with a 400 that says what to send
instead: images (see ``media``), the response format's JSON Schema, Vi's generation config.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loragate.gateway.errors import OpenAIError
from loragate.gateway.media import ImageBudget, MediaPolicy
from loragate.settings import Settings

_VI_KEYS = frozenset({"source", "user_prompt", "system_prompt", "generation_config"})
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

# Vi's generation_config uses Hugging Face names; these map onto OpenAI/vLLM parameters.
HF_TO_OPENAI = {
    "max_new_tokens": "max_tokens",
    "max_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "seed": "seed",
    "stop": "stop",
    "stop_strings": "stop",
    "num_return_sequences": "n",
    "n": "n",
    "logit_bias": "logit_bias",
}

# vLLM dropped these in favour of ``structured_outputs`` and now ignores them silently.
_GUIDED_TO_STRUCTURED = {
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_whitespace_pattern": "whitespace_pattern",
}

IMAGE_HELP = (
    'Send the image as an image_url content part, e.g. {"role": "user", "content": '
    '[{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}, '
    '{"type": "text", "text": "What is in this image?"}]}, or in the Vi format as '
    '{"source": "<local path, http(s) URL or data URI>", "user_prompt": "..."}.'
)


@dataclass(frozen=True)
class ViRequest:
    """The Vi fields of a request, as checked: a local ``source`` file became a data URI."""

    source: str | None
    user_prompt: str | None
    system_prompt: str | None
    generation_config: dict[str, Any] | None


class ChatRequest(dict[str, Any]):
    """An OpenAI chat request body, checked; ``vi`` is the Vi request it came from, if any.

    A plain dict to everything that sends it on (``orjson`` writes it as the OpenAI body);
    backends with a Vi entry point read ``vi``.
    """

    def __init__(self, body: dict[str, Any], vi: ViRequest | None = None) -> None:
        super().__init__(body)
        self.vi = vi


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
    body = {
        key: value for key, value in payload.items() if key not in _VI_KEYS or value is not None
    }
    config = body.pop("generation_config", None)
    if config is not None:
        for key, value in generation_params(config).items():
            if body.get(key) is None:  # top-level parameters take precedence
                body[key] = value
    if has_vi:
        _vi_to_messages(body)
    _translate_guided(body)
    media = _media_policy(
        settings.allowed_media_dir,
        settings.max_image_bytes,
        settings.max_image_pixels,
        settings.private_image_urls,
    )
    try:
        await _check_messages(
            body["messages"],
            media,
            settings.max_messages,
            settings.max_images_per_request,
            ImageBudget(settings.max_body_bytes),
        )
    except OpenAIError as exc:
        if has_vi and exc.param and exc.param.endswith(".image_url.url"):
            exc.param = "source"  # the field the Vi client sent
        raise
    if model_takes_images(settings):
        _require_image(body["messages"], vi=has_vi)
    _check_response_format(body.get("response_format"))
    _check_structured_outputs(body.get("structured_outputs"))
    vi = _vi_request(payload, body["messages"]) if has_vi else None
    return ChatRequest(body, vi)


def media_policy_of(settings: Settings) -> MediaPolicy:
    """The image policy ``settings`` set (--allowed-media-dir, sizes, private URLs)."""
    return _media_policy(
        settings.allowed_media_dir,
        settings.max_image_bytes,
        settings.max_image_pixels,
        settings.private_image_urls,
    )


@functools.lru_cache(maxsize=8)
def _media_policy(
    allowed_dir: Path | None, max_bytes: int, max_pixels: int, private_urls: bool
) -> MediaPolicy:
    return MediaPolicy(allowed_dir, max_bytes, max_pixels, private_urls)


def vi_messages(
    source: str | None, user_prompt: str | None, system_prompt: str | None = None
) -> list[dict[str, Any]]:
    """The OpenAI messages a Vi request stands for: the image part first, the text second."""
    content: list[dict[str, Any]] = []
    if source:
        content.append({"type": "image_url", "image_url": {"url": source}})
    if user_prompt is not None:
        content.append({"type": "text", "text": user_prompt})
    messages: list[dict[str, Any]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": content})
    return messages


def _vi_to_messages(body: dict[str, Any]) -> None:
    source = body.pop("source", None)
    prompt = body.pop("user_prompt", None)
    system = body.pop("system_prompt", None)
    if prompt is not None and not isinstance(prompt, str):
        raise _bad("Vi 'user_prompt' must be a string.", param="user_prompt")
    if source is not None and (not isinstance(source, str) or not source):
        raise _bad(
            "Vi 'source' must be a non-empty string: a local path, an http(s) URL or a data URI.",
            param="source",
        )
    if system is not None and not isinstance(system, str):
        raise _bad("Vi 'system_prompt' must be a string.", param="system_prompt")
    body["messages"] = vi_messages(source, prompt, system)


def _vi_request(payload: dict[str, Any], messages: list[dict[str, Any]]) -> ViRequest:
    source = None
    if _given(payload, "source"):
        # The checked form of the image (local files are data URIs by now), first part.
        source = messages[-1]["content"][0]["image_url"]["url"]
    config = payload.get("generation_config")
    return ViRequest(
        source=source,
        user_prompt=payload.get("user_prompt"),
        system_prompt=payload.get("system_prompt") or None,
        generation_config=dict(config) if isinstance(config, dict) else None,
    )


def generation_params(config: Any) -> dict[str, Any]:
    """OpenAI parameters for a Vi ``generation_config`` (Hugging Face names)."""
    if not isinstance(config, dict):
        raise _bad("'generation_config' must be an object.", param="generation_config")
    unknown = sorted(key for key in config if key not in HF_TO_OPENAI and key != "do_sample")
    if unknown:
        raise _bad(
            f"'generation_config' has unsupported keys {', '.join(unknown)}; supported: "
            f"{', '.join(sorted([*HF_TO_OPENAI, 'do_sample']))}.",
            param=f"generation_config.{unknown[0]}",
            code="unsupported_parameter",
        )
    params: dict[str, Any] = {}
    for key, value in config.items():
        target = HF_TO_OPENAI.get(key)
        if target is not None and value is not None:
            params[target] = value
    do_sample = config.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise _bad(
            "'generation_config.do_sample' must be true or false.",
            param="generation_config.do_sample",
        )
    if do_sample is False:
        params["temperature"] = 0.0  # greedy, as Hugging Face's generate() does without sampling
    return params


def _translate_guided(body: dict[str, Any]) -> None:
    # vLLM 0.32 ignores the old guided_* fields silently; clients still sending them get what they meant.
    schema = body.pop("guided_json", None)
    body.pop(
        "guided_decoding_backend", None
    )  # no per-request choice any more; the engine's applies
    structured = {new: body.pop(old) for old, new in _GUIDED_TO_STRUCTURED.items() if old in body}
    if schema is not None:
        if "response_format" in body or "structured_outputs" in body:
            raise _bad(
                "Send 'guided_json' or 'response_format'/'structured_outputs', not both.",
                param="guided_json",
            )
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError:
                raise _bad(
                    "'guided_json' is not valid JSON.",
                    param="guided_json",
                    code="invalid_json_schema",
                ) from None
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "guided_json", "schema": schema},
        }
    if structured:
        if "structured_outputs" in body:
            raise _bad(
                "Send the guided_* fields or 'structured_outputs', not both.",
                param="structured_outputs",
            )
        body["structured_outputs"] = structured


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
    parts: list[tuple[list[Any], int, str]] = []
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
        parts += [(content, i, f"{where}.content[{i}]") for i in range(len(content))]
    # Counted before any image is read, fetched or decoded.
    images = sum(
        1
        for content, i, _ in parts
        if isinstance(content[i], dict) and _is_image_type(content[i].get("type"))
    )
    if images > max_images:
        raise _bad(
            f"The request has {images} images; this gateway allows {max_images} per request "
            "(max_images_per_request).",
            param="messages",
            code="too_many_images",
        )
    for content, i, where in parts:
        content[i] = await _check_part(content[i], where, media, budget)


# Part types whose image the gateway checks and sends on as an image_url data URI.
IMAGE_PART_TYPES = frozenset({"image_url", "image", "input_image"})


def _is_image_type(kind: object) -> bool:
    return isinstance(kind, str) and kind in IMAGE_PART_TYPES  # a list would be unhashable


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


async def _check_part(part: Any, where: str, media: MediaPolicy, budget: ImageBudget) -> Any:
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


def _has_image(messages: list[dict[str, Any]]) -> bool:
    return any(
        isinstance(message.get("content"), list)
        and any(part.get("type") == "image_url" for part in message["content"])
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


def _check_response_format(response_format: Any) -> None:
    if response_format is None:
        return
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise _bad("'response_format' must be an object with a 'type'.", param="response_format")
    kind = response_format["type"]
    if kind in ("text", "json_object", "structural_tag"):
        return
    if kind != "json_schema":
        raise _bad(
            f"'response_format.type' is {kind!r}; use text, json_object or json_schema.",
            param="response_format.type",
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad(
            '\'response_format.json_schema\' must be an object: {"name": ..., "schema": {...}}.',
            param="response_format.json_schema",
            code="invalid_json_schema",
        )
    spec.setdefault("name", "response")  # OpenAI requires one; the name changes nothing here
    check_json_schema(spec.get("schema"), "response_format.json_schema.schema")


def _check_structured_outputs(structured: Any) -> None:
    if structured is None:
        return
    if not isinstance(structured, dict):
        raise _bad("'structured_outputs' must be an object.", param="structured_outputs")
    schema = structured.get("json")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            raise _bad(
                "'structured_outputs.json' is not valid JSON.",
                param="structured_outputs.json",
                code="invalid_json_schema",
            ) from None
    if schema is not None:
        check_json_schema(schema, "structured_outputs.json")


def check_json_schema(schema: Any, param: str) -> None:
    """400 unless ``schema`` is a valid JSON Schema object (checked against its meta-schema)."""
    if not isinstance(schema, dict):
        raise _bad(
            f"'{param}' must be a JSON Schema object.", param=param, code="invalid_json_schema"
        )
    from jsonschema import exceptions, validators

    try:
        validators.validator_for(schema).check_schema(schema)
    except exceptions.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise _bad(
            f"'{param}' is not a valid JSON Schema: {exc.message}"
            + (f" (at {where})" if where else ""),
            param=param,
            code="invalid_json_schema",
        ) from None


# ----- what kind of model is served -------------------------------------------------------


def model_takes_images(settings: Settings) -> bool:
    """Whether the served base model is a vision-language model.

    ``settings.vision_model`` decides when set; otherwise the model's ``config.json`` does
    (a local directory, or a Hugging Face id already in the cache). The bundled text demo
    and models whose config cannot be read count as text-only.
    """
    if settings.vision_model is not None:
        return settings.vision_model
    if settings.model is None:
        return False
    key = (settings.model, str(settings.cache_dir))
    verdict = _VERDICTS.get(key)
    if verdict is not None:
        return verdict
    if time.monotonic() - _UNKNOWN_SINCE.get(key, -_RECHECK_UNKNOWN_AFTER) < _RECHECK_UNKNOWN_AFTER:
        return False
    config = _read_model_config(settings.model, str(settings.cache_dir.expanduser()))
    if config is None:
        _UNKNOWN_SINCE[key] = time.monotonic()
        return False
    _VERDICTS[key] = verdict = config_takes_images(config)
    return verdict


_VERDICTS: dict[tuple[str, str], bool] = {}
_UNKNOWN_SINCE: dict[tuple[str, str], float] = {}
_RECHECK_UNKNOWN_AFTER = 10.0  # seconds; a model still downloading gets its config.json later


def _read_model_config(model: str, cache_dir: str) -> dict[str, Any] | None:
    path = Path(model).expanduser() / "config.json"
    if not path.is_file():
        if model.count("/") > 1 or model.startswith(("/", ".", "~")):
            return None
        from huggingface_hub import try_to_load_from_cache

        from loragate.adapters.model_cache import hub_cache_holding

        legacy = hub_cache_holding(model, Path(cache_dir) / "models")
        found = try_to_load_from_cache(model, "config.json", cache_dir=legacy)
        if not isinstance(found, str):
            return None
        path = Path(found)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def config_takes_images(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face ``config.json`` describes a model with an image encoder."""
    if isinstance(config.get("vision_config"), dict):
        return True
    if "image_token_id" in config or "image_token_index" in config:
        return True
    architectures = config.get("architectures") or []
    return any(isinstance(a, str) and ("Vision" in a or "VL" in a) for a in architectures)
