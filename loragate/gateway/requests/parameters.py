"""Types and ranges of OpenAI's generation parameters, checked before a request reaches a backend.

The engine would refuse most of these too, but only after the request reached it; checking
here keeps bad requests off the engine (and off custom backends, which get no checks of their
own) and answers with OpenAI's error shape, naming the parameter. Only parameters that are
present are looked at, with a dict lookup and an ``isinstance`` each: a few microseconds.
Unknown parameters pass through untouched (engines take extensions such as
``chat_template_kwargs``); ``max_tokens`` and the chat-only fields (``messages``,
``response_format``, Vi's) are checked where the request is normalized.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

from loragate.gateway.errors import OpenAIError

Route = Literal["chat", "completions"]
Check = Callable[[str, Any], None]

MAX_N = 128  # choices per request; the same bound custom backends get
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
_INT64 = (-(2**63), 2**63 - 1)


def _bad(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, f"'{param}' {message}", param=param, code=code)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)) and math.isfinite(value)


def _boolean(param: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _bad(param, "must be true or false", "invalid_type")


def _number(low: float | None = None, high: float | None = None, *, above: bool = False) -> Check:
    """A finite number in [low, high] (or (low, high] with ``above``)."""

    def check(param: str, value: Any) -> None:
        if not _is_number(value):
            raise _bad(param, "must be a number", "invalid_type")
        if low is not None and (value <= low if above else value < low):
            raise _bad(param, f"must be {'above' if above else 'at least'} {low:g}, got {value!r}")
        if high is not None and value > high:
            raise _bad(param, f"must be at most {high:g}, got {value!r}")

    return check


def _integer(low: int, high: int | None = None) -> Check:
    def check(param: str, value: Any) -> None:
        if not _is_int(value):
            raise _bad(param, "must be an integer", "invalid_type")
        if value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise _bad(param, f"must be {bound}, got {value!r}")

    return check


def _stop(param: str, value: Any) -> None:
    if isinstance(value, str):
        return
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _bad(param, "must be a string or an array of strings", "invalid_type")


def _token_ids(param: str, value: Any) -> None:
    if not isinstance(value, list) or not all(_is_int(item) and item >= 0 for item in value):
        raise _bad(param, "must be an array of token ids (integers, 0 or more)", "invalid_type")


def _logit_bias(param: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise _bad(
            param, 'must be an object of token id -> bias, e.g. {"50256": -100}', "invalid_type"
        )
    for key, bias in value.items():
        if not key.isdigit():
            raise _bad(param, f"keys must be token ids (digits), got {key[:40]!r}")
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise _bad(param, f"values must be numbers between -100 and 100, got {bias!r}")


def _stream_options(param: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise _bad(param, 'must be an object such as {"include_usage": true}', "invalid_type")
    for key in ("include_usage", "continuous_usage_stats"):
        if key in value and value[key] is not None and not isinstance(value[key], bool):
            raise _bad(f"{param}.{key}", "must be true or false", "invalid_type")


def _string(param: str, value: Any) -> None:
    if not isinstance(value, str):
        raise _bad(param, "must be a string", "invalid_type")


def _object_list(param: str, value: Any) -> None:
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise _bad(param, "must be an array of objects", "invalid_type")


def _tool_choice(param: str, value: Any) -> None:
    if not isinstance(value, str | dict):
        raise _bad(param, 'must be "none", "auto", "required" or an object', "invalid_type")


def _prompt(param: str, value: Any) -> None:
    if isinstance(value, str):
        return
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return
        if all(_is_int(item) for item in value):
            return
        if all(isinstance(item, list) and all(_is_int(t) for t in item) for item in value):
            return
    raise _bad(
        param,
        "must be a string, an array of strings, or token ids (an array of integers, or of arrays)",
        "invalid_type",
    )


_COMMON: dict[str, Check] = {
    "stream": _boolean,
    "stream_options": _stream_options,
    "temperature": _number(0),
    "top_p": _number(0, 1, above=True),
    "top_k": _integer(-1),
    "min_p": _number(0, 1),
    "n": _integer(1, MAX_N),
    "seed": _integer(*_INT64),
    "stop": _stop,
    "stop_token_ids": _token_ids,
    "presence_penalty": _number(-2, 2),
    "frequency_penalty": _number(-2, 2),
    "repetition_penalty": _number(0, above=True),
    "logit_bias": _logit_bias,
    "min_tokens": _integer(0),
    "ignore_eos": _boolean,
    "skip_special_tokens": _boolean,
    "include_stop_str_in_output": _boolean,
    "user": _string,
}

_BY_ROUTE: dict[Route, dict[str, Check]] = {
    "chat": {
        **_COMMON,
        "logprobs": _boolean,
        "top_logprobs": _integer(0, MAX_LOGPROBS),
        "tools": _object_list,
        "tool_choice": _tool_choice,
        "parallel_tool_calls": _boolean,
    },
    "completions": {
        **_COMMON,
        "prompt": _prompt,
        "logprobs": _integer(0, MAX_LOGPROBS),
        "echo": _boolean,
        "suffix": _string,
    },
}


def check_parameters(payload: dict[str, Any], route: Route) -> None:
    """400 (OpenAI-shaped, naming the parameter) for a known parameter of the wrong type or range.

    ``null`` means "not given", as OpenAI's SDKs send it. A completions request needs a
    ``prompt``.
    """
    checks = _BY_ROUTE[route]
    for key, value in payload.items():
        check = checks.get(key)
        if check is not None and value is not None:
            check(key, value)
    if (
        route == "completions"
        and payload.get("prompt") is None
        and payload.get("prompt_embeds") is None
    ):
        raise OpenAIError(
            400,
            "A completions request needs a 'prompt' (a string, or an array of them).",
            param="prompt",
            code="missing_prompt",
        )
