"""A chat request's output constraints: ``response_format``, ``structured_outputs`` and the
old ``guided_*`` fields, checked (JSON Schemas against their meta-schema) before the engine
sees them."""

from __future__ import annotations

from typing import Any

from loragate.gateway.errors import OpenAIError
from loragate.gateway.requests.body import parse_json

# vLLM dropped these in favour of ``structured_outputs`` and now ignores them silently.
_GUIDED_TO_STRUCTURED = {
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_whitespace_pattern": "whitespace_pattern",
}


def _bad(message: str, param: str, code: str = "invalid_request") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def _schema_text(text: str, param: str) -> Any:
    """A JSON schema sent as a string, parsed (vLLM accepts both forms) under the body's own
    shape limits (``body.parse_json``): it is a body inside the body."""
    try:
        return parse_json(text, f"'{param}'", param)
    except OpenAIError as exc:
        if exc.code != "invalid_json":
            raise
        raise _bad(
            f"'{param}' is not valid JSON.", param=param, code="invalid_json_schema"
        ) from None


def translate_guided(body: dict[str, Any]) -> None:
    """Turn the ``guided_*`` fields of ``body`` into ``response_format``/``structured_outputs``."""
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
            schema = _schema_text(schema, "guided_json")
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


def check_response_format(response_format: Any) -> None:
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


def check_structured_outputs(structured: Any) -> None:
    if structured is None:
        return
    if not isinstance(structured, dict):
        raise _bad("'structured_outputs' must be an object.", param="structured_outputs")
    schema = structured.get("json")
    if isinstance(schema, str):
        schema = _schema_text(schema, "structured_outputs.json")
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
