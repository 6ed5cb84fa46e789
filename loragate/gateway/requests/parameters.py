"""OpenAI's generation parameters, in one table (``PARAMETERS``) that yields both their checks
and their OpenAPI description.

Each row names a parameter, the routes that take it, its kind (the type and range), its
default and what it means; the 400s ``check_parameters`` answers and the request-body
properties ``parameter_schemas`` gives ``/openapi.json`` are both read from the row, so the two
cannot disagree on a bound (tests/unit/test_parameter_table.py probes every row both ways).

The engine would refuse most of these too, but only after the request reached it; checking
here keeps bad requests off the engine (and off custom backends, which get no checks of their
own) and answers with OpenAI's error shape, naming the parameter. Only parameters that are
present are looked at, with a dict lookup and an ``isinstance`` each: a few microseconds.
Unknown parameters pass through untouched (engines take extensions such as
``chat_template_kwargs``); the chat-only fields (``messages``, ``response_format``, Vi's) are
checked where the request is normalized, and ``--max-tokens-cap`` where the limits are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from loragate.gateway.errors import OpenAIError
from loragate.gateway.generation_routes import BY_KIND, Route

ROUTES: tuple[Route, ...] = tuple(BY_KIND)  # the generation routes the gateway checks itself
Schema = dict[str, Any]

MAX_N = 128  # choices per request; the same bound custom backends get
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
_INT64 = (-(2**63), 2**63 - 1)


def _bad(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, f"'{param}' {message}", param=param, code=code)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)) and math.isfinite(value)


class Kind(Protocol):
    """A parameter's type and range: the check and the JSON Schema, side by side."""

    def check(self, param: str, value: Any) -> None:
        """Raise a 400 naming ``param`` unless ``value`` (never ``None``) is of this kind."""

    def schema(self) -> Schema:
        """The JSON Schema of the values ``check`` accepts."""


class Boolean:
    def check(self, param: str, value: Any) -> None:
        if not isinstance(value, bool):
            raise _bad(param, "must be true or false", "invalid_type")

    def schema(self) -> Schema:
        return {"type": "boolean"}


@dataclass(frozen=True)
class Number:
    """A finite number in [low, high] (or (low, high] with ``above``)."""

    low: float | None = None
    high: float | None = None
    above: bool = False

    def check(self, param: str, value: Any) -> None:
        low, high, above = self.low, self.high, self.above
        if not _is_number(value):
            raise _bad(param, "must be a number", "invalid_type")
        if low is not None and (value <= low if above else value < low):
            raise _bad(param, f"must be {'above' if above else 'at least'} {low:g}, got {value!r}")
        if high is not None and value > high:
            raise _bad(param, f"must be at most {high:g}, got {value!r}")

    def schema(self) -> Schema:
        schema: Schema = {"type": "number"}
        if self.low is not None:
            schema["exclusiveMinimum" if self.above else "minimum"] = self.low
        if self.high is not None:
            schema["maximum"] = self.high
        return schema


@dataclass(frozen=True)
class Integer:
    """An integer in [low, high] (no upper bound without ``high``)."""

    low: int
    high: int | None = None

    def check(self, param: str, value: Any) -> None:
        if not _is_int(value):
            raise _bad(param, "must be an integer", "invalid_type")
        if value < self.low or (self.high is not None and value > self.high):
            bound = (
                f"between {self.low} and {self.high}"
                if self.high is not None
                else f"at least {self.low}"
            )
            raise _bad(param, f"must be {bound}, got {value!r}")

    def schema(self) -> Schema:
        schema: Schema = {"type": "integer", "minimum": self.low}
        if self.high is not None:
            schema["maximum"] = self.high
        return schema


class TokenLimit:
    """A number of tokens to generate, one or more: a wrong type and 0 read the same."""

    least = 1

    def check(self, param: str, value: Any) -> None:
        if not _is_int(value) or value < self.least:
            raise _bad(param, "must be a positive integer")

    def schema(self) -> Schema:
        return {"type": "integer", "minimum": self.least}


class String:
    def check(self, param: str, value: Any) -> None:
        if not isinstance(value, str):
            raise _bad(param, "must be a string", "invalid_type")

    def schema(self) -> Schema:
        return {"type": "string"}


class Strings:
    """A string or an array of them (``stop``)."""

    def check(self, param: str, value: Any) -> None:
        if isinstance(value, str):
            return
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise _bad(param, "must be a string or an array of strings", "invalid_type")

    def schema(self) -> Schema:
        return {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}


class TokenIds:
    least = 0

    def check(self, param: str, value: Any) -> None:
        if not isinstance(value, list) or not all(
            _is_int(item) and item >= self.least for item in value
        ):
            raise _bad(
                param,
                f"must be an array of token ids (integers, {self.least} or more)",
                "invalid_type",
            )

    def schema(self) -> Schema:
        return {"type": "array", "items": {"type": "integer", "minimum": self.least}}


@dataclass(frozen=True)
class LogitBias:
    """An object of token id (digits) -> a bias in [low, high]."""

    low: int
    high: int

    def check(self, param: str, value: Any) -> None:
        if not isinstance(value, dict):
            raise _bad(
                param, 'must be an object of token id -> bias, e.g. {"50256": -100}', "invalid_type"
            )
        for key, bias in value.items():
            if not key.isdigit():
                raise _bad(param, f"keys must be token ids (digits), got {key[:40]!r}")
            if not _is_number(bias) or not self.low <= bias <= self.high:
                raise _bad(
                    param,
                    f"values must be numbers between {self.low} and {self.high}, got {bias!r}",
                )

    def schema(self) -> Schema:
        return {
            "type": "object",
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {"type": "number", "minimum": self.low, "maximum": self.high},
        }


@dataclass(frozen=True)
class Switches:
    """An object whose ``keys`` are each true, false or null (``stream_options``)."""

    keys: tuple[str, ...]
    example: str

    def check(self, param: str, value: Any) -> None:
        if not isinstance(value, dict):
            raise _bad(param, f"must be an object such as {self.example}", "invalid_type")
        for key in self.keys:
            if key in value and value[key] is not None and not isinstance(value[key], bool):
                raise _bad(f"{param}.{key}", "must be true or false", "invalid_type")

    def schema(self) -> Schema:
        return {
            "type": "object",
            "properties": {key: {"type": ["boolean", "null"]} for key in self.keys},
        }


class ObjectList:
    def check(self, param: str, value: Any) -> None:
        if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
            raise _bad(param, "must be an array of objects", "invalid_type")

    def schema(self) -> Schema:
        return {"type": "array", "items": {"type": "object"}}


class ToolChoice:
    """A mode's name or a tool object; which names and tools exist, the engine checks."""

    def check(self, param: str, value: Any) -> None:
        if not isinstance(value, str | dict):
            raise _bad(param, 'must be "none", "auto", "required" or an object', "invalid_type")

    def schema(self) -> Schema:
        return {"anyOf": [{"type": "string"}, {"type": "object"}]}


class Prompt:
    """Text, texts, or token ids: one prompt's or a batch's (an array of arrays)."""

    def check(self, param: str, value: Any) -> None:
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
            "must be a string, an array of strings, or token ids (an array of integers, or of "
            "arrays)",
            "invalid_type",
        )

    def schema(self) -> Schema:
        def non_empty(items: Schema) -> Schema:
            return {"type": "array", "minItems": 1, "items": items}

        integer: Schema = {"type": "integer"}
        return {
            "anyOf": [
                {"type": "string"},
                non_empty({"type": "string"}),
                non_empty(integer),
                non_empty({"type": "array", "items": integer}),
            ]
        }


@dataclass(frozen=True)
class Parameter:
    """One row of the table: what the check and the OpenAPI property are both made from."""

    name: str
    kind: Kind
    description: str
    routes: tuple[Route, ...] = ROUTES
    default: Any = None  # the engine's, documented; None: none worth stating
    required: bool = False  # the route refuses a request without it

    def schema(self) -> Schema:
        """The request-body property: ``null`` means "not given" (as SDKs send it) unless the
        parameter is required."""
        kind = self.kind.schema()
        schema: Schema = kind if self.required else {"anyOf": [kind, {"type": "null"}]}
        schema = {**schema, "description": self.description}
        if self.default is not None:
            schema["default"] = self.default
        return schema


_BOOLEAN = Boolean()
_MODEL_DEFAULT = "Unset: the model's generation_config.json, else {}."

PARAMETERS: tuple[Parameter, ...] = (
    Parameter("stream", _BOOLEAN, "Answer in server-sent events.", default=False),
    Parameter(
        "stream_options",
        Switches(("include_usage", "continuous_usage_stats"), '{"include_usage": true}'),
        "With `stream`: `include_usage` adds a last event with the token counts.",
    ),
    Parameter(
        "max_tokens",
        TokenLimit(),
        "The most tokens to generate (capped by --max-tokens-cap).",
    ),
    Parameter(
        "max_completion_tokens",
        TokenLimit(),
        "OpenAI's newer name for `max_tokens` (capped by --max-tokens-cap).",
    ),
    Parameter(
        "temperature", Number(0), "Sampling temperature; 0 is greedy. " + _MODEL_DEFAULT.format(1)
    ),
    Parameter(
        "top_p",
        Number(0, 1, above=True),
        "Nucleus sampling: the smallest set of tokens whose probabilities add up to this. "
        + _MODEL_DEFAULT.format(1),
    ),
    Parameter(
        "top_k",
        Integer(-1),
        "Sample from the k likeliest tokens; -1 (or 0) for all. " + _MODEL_DEFAULT.format(-1),
    ),
    Parameter(
        "min_p",
        Number(0, 1),
        "Drop tokens less likely than this fraction of the likeliest one. "
        + _MODEL_DEFAULT.format(0),
    ),
    Parameter("n", Integer(1, MAX_N), "How many choices to generate.", default=1),
    Parameter("seed", Integer(*_INT64), "Makes sampling repeatable."),
    Parameter(
        "stop", Strings(), "Text that ends the generation (left out of the answer by default)."
    ),
    Parameter("stop_token_ids", TokenIds(), "Token ids that end the generation."),
    Parameter(
        "presence_penalty",
        Number(-2, 2),
        "Penalizes tokens that appeared at all, so new topics come up.",
        default=0,
    ),
    Parameter(
        "frequency_penalty",
        Number(-2, 2),
        "Penalizes tokens by how often they appeared, so text repeats less.",
        default=0,
    ),
    Parameter(
        "repetition_penalty",
        Number(0, above=True),
        "Above 1 makes tokens already seen less likely, below 1 more (1: off). "
        + _MODEL_DEFAULT.format(1),
    ),
    Parameter(
        "logit_bias",
        LogitBias(-100, 100),
        "Added to the logits of the given token ids; -100 bans a token, 100 forces it.",
    ),
    Parameter("min_tokens", Integer(0), "Tokens to generate before a stop may end it.", default=0),
    Parameter("ignore_eos", _BOOLEAN, "Keep generating past end-of-sequence.", default=False),
    Parameter(
        "skip_special_tokens", _BOOLEAN, "Leave special tokens out of the text.", default=True
    ),
    Parameter(
        "include_stop_str_in_output",
        _BOOLEAN,
        "Keep the `stop` text that ended the generation in the answer.",
        default=False,
    ),
    Parameter("user", String(), "An end-user id, for the caller's own records."),
    # Chat only.
    Parameter(
        "logprobs", _BOOLEAN, "Return each token's log probability.", ("chat",), default=False
    ),
    Parameter(
        "top_logprobs",
        Integer(0, MAX_LOGPROBS),
        "With `logprobs`: how many of the likeliest alternatives to list per token.",
        ("chat",),
    ),
    Parameter("tools", ObjectList(), "Functions the model may call.", ("chat",)),
    Parameter(
        "tool_choice",
        ToolChoice(),
        '"none", "auto", "required", or {"type": "function", "function": {"name": ...}}.',
        ("chat",),
    ),
    Parameter(
        "parallel_tool_calls", _BOOLEAN, "Allow several tool calls in one answer.", ("chat",)
    ),
    # Completions only.
    Parameter(
        "prompt",
        Prompt(),
        "The text to continue, several texts, or token ids (one prompt's, or a batch's).",
        ("completions",),
        required=True,
    ),
    Parameter(
        "logprobs",
        Integer(0, MAX_LOGPROBS),
        "Return the log probabilities of this many likeliest tokens per position.",
        ("completions",),
    ),
    Parameter(
        "echo", _BOOLEAN, "Start the answer with the prompt.", ("completions",), default=False
    ),
    Parameter("suffix", String(), "Text that comes after the completion.", ("completions",)),
)


def parameters_of(route: Route) -> tuple[Parameter, ...]:
    """The rows ``route`` takes, in the table's order."""
    return tuple(parameter for parameter in PARAMETERS if route in parameter.routes)


def parameter_schemas(route: Route) -> dict[str, Schema]:
    """The OpenAPI request-body properties of ``route``'s generation parameters."""
    return {parameter.name: parameter.schema() for parameter in parameters_of(route)}


_CHECKS: dict[Route, dict[str, Callable[[str, Any], None]]] = {
    route: {parameter.name: parameter.kind.check for parameter in parameters_of(route)}
    for route in ROUTES
}


def check_parameters(payload: dict[str, Any], route: Route) -> None:
    """400 (OpenAI-shaped, naming the parameter) for a known parameter of the wrong type or range.

    ``null`` means "not given", as OpenAI's SDKs send it. A completions request needs a
    ``prompt`` (or vLLM's ``prompt_embeds``).
    """
    checks = _CHECKS[route]
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
