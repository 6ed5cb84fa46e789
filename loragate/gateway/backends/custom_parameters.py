"""What a custom backend's OpenAI parameters mean: ``generation_config`` under the Hugging Face
names the Vi SDK passes, and ``stop`` strings, which cut the output whatever the backend does
with them; for a backend written for the Vi SDK's own server, ``generation_config`` and
``response_format`` exactly as that server builds them, and the requests its schema refuses."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, create_model

from loragate.gateway.errors import OpenAIError

# OpenAI parameter -> the Hugging Face name backends get it under.
_OPENAI_TO_HF = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "logit_bias": "logit_bias",
}


def generation_config_of(body: dict[str, Any]) -> dict[str, Any]:
    """The ``generation_config`` a backend gets for an OpenAI request body."""
    config: dict[str, Any] = {}
    for key, target in _OPENAI_TO_HF.items():
        value = body.get(key)
        if value is not None:
            config[target] = value
    if "stop" in config:
        config["stop"] = stop_strings(config["stop"])
    temperature = config.get("temperature")
    if isinstance(temperature, int | float):
        config["do_sample"] = temperature > 0
    return config


def stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise OpenAIError(
        400, "'stop' must be a string or an array of strings.", param="stop", code="invalid_type"
    )


class StopScanner:
    """Cuts streamed text at the first stop string, holding back only what could start one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        if not self.stops:
            return piece
        text, self.stopped = cut_at_stop(self.pending + piece, self.stops)
        if self.stopped:
            self.pending = ""
            return text
        keep = min(self.hold, len(text))
        self.pending = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        rest, self.pending = self.pending, ""
        return rest


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


# ----- a backend written for the Vi SDK's server gets what that server hands it ------------

VI_DEFAULT_TEMPERATURE = 0.7
"""What the Vi server's request schema defaults ``temperature`` to
(``vi/deployment/local/schemas.py``: ``ChatCompletionRequest.temperature``)."""

# The bounds (least, most) the Vi server's request schema puts on its top-level fields
# (``ChatCompletionRequest``'s ``ge`` and ``le``; tests/unit/test_vi_dropin.py checks them
# against the installed SDK). Copied, so serving a Vi backend needs no vi-sdk installed.
VI_BOUNDS: dict[str, tuple[float | None, float | None]] = {
    "temperature": (0.0, 2.0),
    "max_tokens": (1, None),
    "top_p": (0.0, 1.0),
    "top_k": (1, None),
    "repetition_penalty": (0.0, None),
}
VI_ROLES = ("system", "user", "assistant")  # the schema's ChatMessage.role


def check_vi_schema(sent: dict[str, Any], messages: list[dict[str, Any]]) -> None:
    """A 400 for what the Vi server's request schema refuses (a 422 there) and loragate's own
    checks let through, before a backend written for that server is asked: no ``model`` (the
    Vi server has no default model), a top-level value outside ``VI_BOUNDS`` (``sent``: the
    body as the client sent it), a role other than ``VI_ROLES`` (no ``developer``, ``tool``
    or ``function``: such a backend was never handed one) or a null ``content``."""
    if sent.get("model") is None:
        raise OpenAIError(
            400,
            "The request names no 'model'; a backend written for the Vi SDK's server is asked "
            "for one of its models by name (GET /v1/models lists them).",
            param="model",
            code="missing_model",
        )
    for field, (least, most) in VI_BOUNDS.items():
        value = sent.get(field)
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue  # absent, or refused by loragate's own checks already
        if (least is not None and value < least) or (most is not None and value > most):
            bounds = [f"at least {least:g}"] if least is not None else []
            bounds += [f"at most {most:g}"] if most is not None else []
            raise OpenAIError(
                400,
                f"'{field}' must be {' and '.join(bounds)} for this backend (the Vi SDK "
                f"server's bound), got {value!r}",
                param=field,
                code="invalid_value",
            )
    for index, message in enumerate(messages):
        role = message.get("role")
        if role not in VI_ROLES:
            hint = " Send its text as a 'system' message." if role == "developer" else ""
            raise OpenAIError(
                400,
                f"messages[{index}].role is {role!r}; a backend written for the Vi SDK's server "
                f"takes {', '.join(VI_ROLES)} only.{hint}",
                param=f"messages[{index}].role",
                code="invalid_role",
            )
        if message.get("content") is None:
            raise OpenAIError(
                400,
                f"messages[{index}].content is null; a backend written for the Vi SDK's server "
                "takes a string or an array of parts.",
                param=f"messages[{index}].content",
                code="invalid_request",
            )


# Top-level request field -> the generation_config key the Vi server puts it under.
_VI_TO_CONFIG = {
    "max_tokens": "max_new_tokens",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "repetition_penalty": "repetition_penalty",
    "stop": "stop",
    "logit_bias": "logit_bias",
}


def vi_generation_config(sent: dict[str, Any]) -> dict[str, Any]:
    """The ``generation_config`` the Vi server hands its backend for the body ``sent``, rule for
    rule as ``vi/deployment/local/utils.py``: ``build_generation_config_from_request`` builds
    it: the request's own ``generation_config`` as sent, then the top-level fields over it
    (``temperature`` 0.7 when absent, with ``do_sample``), and OpenAI's penalties folded into
    ``repetition_penalty`` when it is not set."""
    config: dict[str, Any] = dict(sent.get("generation_config") or {})
    temperature = sent.get("temperature")
    temperature = VI_DEFAULT_TEMPERATURE if temperature is None else float(temperature)
    config["temperature"] = temperature
    config["do_sample"] = temperature > 0.0
    for field, key in _VI_TO_CONFIG.items():
        if sent.get(field) is not None:
            config[key] = sent[field]
    frequency, presence = sent.get("frequency_penalty"), sent.get("presence_penalty")
    if (frequency is not None or presence is not None) and "repetition_penalty" not in config:
        combined = 1.0  # summed in the Vi server's order, so the float is the same
        if frequency is not None:
            combined += frequency * 0.1
        if presence is not None:
            combined += presence * 0.1
        if combined != 1.0:
            config["repetition_penalty"] = combined
    return config


def vi_response_model(response_format: dict[str, Any] | None) -> type[BaseModel] | None:
    """``response_format`` as the Pydantic model class the Vi server hands its backend
    (``vi/deployment/local/schema_utils.py``: ``convert_response_format_to_pydantic``): only a
    ``json_schema`` with a schema becomes one (``json_object`` becomes None, as there)."""
    if not response_format or response_format.get("type") != "json_schema":
        return None
    spec = response_format.get("json_schema") or {}
    schema = spec.get("schema") or {}
    if not schema:
        return None
    return _pydantic_model(schema, spec.get("name", "CustomResponse"), "response_format")


def _pydantic_model(schema: dict[str, Any], name: str, where: str) -> type[BaseModel]:
    # As the Vi server's json_schema_to_pydantic: an object's properties become fields, the
    # required ones without a default, the others optional with None.
    if schema.get("type") != "object":
        raise OpenAIError(
            400,
            f"A backend written for the Vi SDK takes an object schema only (the Vi server "
            f"converts no other), got type {schema.get('type')!r} at {where}.",
            param="response_format",
            code="invalid_json_schema",
        )
    required = set(schema.get("required", []))
    fields: dict[str, Any] = {}
    for field, field_schema in schema.get("properties", {}).items():
        annotation = _python_type(field_schema, f"{where}.{field}")
        if field in required:
            fields[field] = (annotation, ...)
        elif hasattr(annotation, "__origin__"):
            fields[field] = (annotation, None)
        else:
            fields[field] = (annotation | None, None)
    return create_model(name, **fields)


def _python_type(schema: dict[str, Any], where: str) -> Any:
    kind = schema.get("type")
    if kind == "array":
        items = schema.get("items", {})
        return list[_python_type(items, where)] if items else list[Any]  # type: ignore[misc]
    if kind == "object":
        return _pydantic_model(schema, schema.get("title", "NestedModel"), where)
    if "enum" in schema:
        return str
    return _JSON_TYPES.get(kind, Any)


_JSON_TYPES: dict[Any, Any] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "null": type(None),
}
