"""A version's preset applied to the request it serves, and the rules its values obey.

The backend calls ``apply_preset`` once it has leased the version that will answer (the lease
names it), so each request gets the preset of the version that served it, whatever swap or
rollback happens meanwhile. What a request sends wins over the preset's defaults, never over
its clamps: a value above a clamp is a 400 naming the parameter. The token limit the gateway
fills in where a request asks none (``CapFill``, --max-tokens-cap) is no ask: the preset's
own limit takes its place, within the cap. ``parameter_rules`` checks a
preset's defaults and clamps with the generation-parameter table (``parameters.PARAMETERS``),
the same checks a request's own values get.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from loragate.adapters.preset import Preset, thawed
from loragate.gateway.errors import OpenAIError
from loragate.gateway.generation_routes import Route, kind_of
from loragate.gateway.requests.parameters import PARAMETERS, ROUTES, parameters_of

if TYPE_CHECKING:
    from loragate.gateway.backends.base import EngineCall

# A preset may set these parameters (not the request's shape: its prompt, or streaming).
_NOT_PRESET = frozenset({"prompt", "stream", "stream_options", "user"})
_KINDS: dict[str, list[Any]] = {}
for _row in PARAMETERS:
    if _row.name not in _NOT_PRESET:
        _KINDS.setdefault(_row.name, []).append(_row.kind)
_TAKES: dict[Route, frozenset[str]] = {
    route: frozenset(p.name for p in parameters_of(route)) for route in ROUTES
}
_TOKEN_LIMITS = ("max_tokens", "max_completion_tokens")
# A request that asks for structured output its own way keeps it (no default format added).
_OWN_FORMAT = ("response_format", "structured_outputs", "guided_json", "guided_regex")


class CapFill(int):
    """The token limit the gateway set on a request that asked none: its ``cap``
    (--max-tokens-cap), or the engine's own default when lower. An ``int`` to all else."""

    cap: int

    def __new__(cls, value: int, cap: int | None = None) -> CapFill:
        fill = super().__new__(cls, value)
        fill.cap = value if cap is None else cap  # None: as a copy is made, ``cap`` set after
        return fill


def parameter_rules(name: str, value: Any) -> None:
    """``KeyError`` for a name a preset cannot set; ``ValueError`` (the table's words) for a
    value no route of the table accepts."""
    kinds = _KINDS.get(name)
    if kinds is None:
        raise KeyError(name)
    problems = []
    for kind in kinds:  # ``logprobs`` is a switch in chat and a count in completions
        try:
            kind.check(name, value)
            return
        except OpenAIError as exc:
            problems.append(exc.message)
    raise ValueError(problems[0])


def shaped_body(preset: Preset | None, call: EngineCall, engine_id: str | None) -> bytes:
    """The bytes to send for ``call``, which leased ``engine_id``: a generation request
    shaped by the version's ``preset``; else the call's own body. 400 (``OpenAIError``) for
    a request the preset refuses (a clamp): the caller gives its lease back."""
    route = kind_of(call.path)  # None: a preset does not apply to it
    if preset is None or call.payload is None or route is None:
        return call.body(engine_id)
    return orjson.dumps({**apply_preset(preset, call.payload, route), "model": engine_id})


def apply_preset(preset: Preset, payload: dict[str, Any], route: Route) -> dict[str, Any]:
    """``payload`` as ``preset`` shapes it (a new dict: ``payload`` is left as it was, so a
    request sent again after an engine restart is shaped afresh); 400 when it breaks a clamp."""
    shaped = dict(payload)
    fill = next((shaped.pop(n) for n in _TOKEN_LIMITS if isinstance(shaped.get(n), CapFill)), None)
    for name, limit in preset.clamps.items():
        value = shaped.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > limit:
            raise OpenAIError(
                400,
                f"'{name}' is {value}; this model's preset allows at most {limit:g}",
                param=name,
                code="preset_clamp_exceeded",
            )
    takes = _TAKES[route]
    for name, value in preset.defaults.items():
        if name in takes and shaped.get(name) is None and _fits(name, value, route):
            shaped[name] = thawed(value)
    for name in _TOKEN_LIMITS:  # no limit asked: the clamp is the limit
        if name in preset.clamps and all(shaped.get(n) is None for n in _TOKEN_LIMITS):
            shaped[name] = int(preset.clamps[name])
    if fill is not None:  # the request asked no limit: the preset's, within the cap, or the fill
        limits = [name for name in _TOKEN_LIMITS if shaped.get(name) is not None]
        for name in limits:
            shaped[name] = min(shaped[name], fill.cap)
        if not limits:
            shaped["max_tokens"] = fill
    if preset.stop:
        own = shaped.get("stop")
        own = [own] if isinstance(own, str) else list(own or [])
        shaped["stop"] = list(dict.fromkeys([*own, *preset.stop]))
    if route == "chat":
        _shape_chat(preset, shaped, payload)
    return shaped


def _fits(name: str, value: Any, route: Route) -> bool:
    """Whether ``route``'s row of ``name`` takes ``value`` (``logprobs`` differs by route)."""
    for row in parameters_of(route):
        if row.name == name:
            try:
                row.kind.check(name, value)
            except OpenAIError:
                return False
            return True
    return False


def _shape_chat(preset: Preset, shaped: dict[str, Any], payload: dict[str, Any]) -> None:
    messages = shaped.get("messages")
    if isinstance(messages, list):
        messages = list(messages)
        if preset.user_prompt is not None and _vi_without_prompt(payload):
            last = dict(messages[-1])
            last["content"] = [*last["content"], {"type": "text", "text": preset.user_prompt}]
            messages[-1] = last
        if preset.system_prompt is not None:
            always = preset.system_prompt_mode == "always"
            if always:  # the version's own prompt, whatever the request sent as its system
                messages = [m for m in messages if not _is_system(m)]
            if always or not any(_is_system(m) for m in messages):
                messages.insert(0, {"role": "system", "content": preset.system_prompt})
        shaped["messages"] = messages
    if preset.response_format is not None and all(shaped.get(k) is None for k in _OWN_FORMAT):
        shaped["response_format"] = thawed(preset.response_format)
    if preset.chat_template is not None and shaped.get("chat_template") is None:
        shaped["chat_template"] = preset.chat_template


def _is_system(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") in ("system", "developer")


def _vi_without_prompt(payload: dict[str, Any]) -> bool:
    """A Vi request that sent a ``source`` and no ``user_prompt`` (``ChatRequest.vi``)."""
    vi = getattr(payload, "vi", None)
    return vi is not None and vi.user_prompt is None and vi.source is not None
