"""Datature Vi's flat request shape, and the OpenAI messages it stands for.

A Vi request is ``source`` (the image: a local path, an http(s) URL, a data URI or raw base64,
as the Vi server's schema documents it; or a video file, for Vi's ``video-freeform`` task) and
``user_prompt``, with an optional ``system_prompt`` and a ``generation_config`` under Hugging
Face names. It becomes one user message with the media part first (``image_url``, or
``video_url`` for a video) and the text part second;
``ViRequest`` keeps what was sent, so a backend with its own Vi entry point
(``InferenceBackend.generate_vi_format``) still gets it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loragate.gateway.errors import OpenAIError
from loragate.gateway.requests.images.resolve import raw_base64_uri
from loragate.gateway.requests.images.video import names_a_video

VI_KEYS = frozenset({"source", "user_prompt", "system_prompt", "generation_config"})

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


@dataclass(frozen=True)
class ViRequest:
    """The Vi fields of a request, as checked: a local ``source`` file became a data URI."""

    source: str | None
    user_prompt: str | None
    system_prompt: str | None
    generation_config: dict[str, Any] | None


def _bad(message: str, param: str, code: str = "invalid_request") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def vi_messages(
    source: str | None, user_prompt: str | None, system_prompt: str | None = None
) -> list[dict[str, Any]]:
    """The OpenAI messages a Vi request stands for: the image (or video) part first, the text
    second."""
    content: list[dict[str, Any]] = []
    if source:
        kind = "video_url" if names_a_video(source) else "image_url"
        content.append({"type": kind, kind: {"url": source}})
    if user_prompt is not None:
        content.append({"type": "text", "text": user_prompt})
    messages: list[dict[str, Any]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": content})
    return messages


def vi_to_messages(body: dict[str, Any]) -> None:
    """Replace the Vi fields of ``body`` by the ``messages`` they stand for; 400 if mistyped."""
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
    if source is not None:
        source = raw_base64_uri(source) or source
    body["messages"] = vi_messages(source, prompt, system)


def vi_request(payload: dict[str, Any], messages: list[dict[str, Any]]) -> ViRequest:
    """The Vi request ``payload`` was, with the image as ``messages`` hold it once checked."""
    source = None
    if payload.get("source") is not None:  # typed clients send absent fields as null
        # The checked form of the image or video (local files are data URIs by now), first part.
        first = messages[-1]["content"][0]
        source = first[first["type"]]["url"]
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
