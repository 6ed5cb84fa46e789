"""A preset: how a version of an adapter is asked, stored with its weights and part of its id.

A fine-tune is trained with a system prompt, a chat format, sampling settings and often an
output schema; served without them it sees prompts unlike its training. A preset carries them
with the version: a system prompt (used when the request has none, or ``always``), a chat
template, sampling ``defaults`` (a request's own values win), ``clamps`` (upper limits a
request may not exceed: a 400 naming the parameter), ``stop`` strings (added to the
request's), a default ``response_format`` and a default ``user_prompt`` for a Vi request that
sends only a ``source``. The fields are those of a Datature Vi run's ``run.json`` (its system
prompt, its task's default prompt and output schema, its generation config), so one can
become a preset.

``Preset.from_dict`` is the one check of a preset, wherever it comes from (the admin API, a
manifest entry, a ``loragate.json`` beside the adapter's files): unknown keys and wrong types
are refused naming the key; the values of ``defaults`` and ``clamps`` are checked by the
``ParameterRules`` the caller hands in (the gateway's generation-parameter table: this layer
sits below it). ``canonical`` is the preset as sorted, compact JSON and ``digest`` its sha256:
the store folds it into the version's id, so the same weights with another preset are another
version. An empty preset is no preset: its version id is that of the weights alone.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from loragate.fetching.json_file import is_finite_number

# Checks one generation parameter's value (a default or a clamp): raises ``ValueError`` saying
# what is wrong, or ``KeyError`` for a name that is no generation parameter.
ParameterRules = Callable[[str, Any], None]

SYSTEM_PROMPT_MODES = ("default", "always")
MAX_PRESET_BYTES = 256 << 10  # a long system prompt and a schema fit many times over


class PresetError(ValueError):
    """A preset that does not hold; ``key`` is where (``preset.defaults.temperature``)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


def _frozen(value: Any) -> Any:
    """A JSON value that nothing can change in place (objects as read-only mappings)."""
    if isinstance(value, dict):
        return MappingProxyType({key: _frozen(item) for key, item in value.items()})
    if isinstance(value, list):
        return tuple(_frozen(item) for item in value)
    return value


def thawed(value: Any) -> Any:
    """A fresh, mutable copy of a value of a preset (to put into a request)."""
    if isinstance(value, Mapping):
        return {key: thawed(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return [thawed(item) for item in value]
    return value


def _empty() -> Mapping[str, Any]:
    return MappingProxyType({})


@dataclass(frozen=True)
class Preset:
    system_prompt: str | None = None
    system_prompt_mode: str = "default"  # "always": the request's system messages give way
    defaults: Mapping[str, Any] = field(default_factory=_empty)
    clamps: Mapping[str, int | float] = field(default_factory=_empty)
    stop: tuple[str, ...] = ()
    response_format: Mapping[str, Any] | None = None
    user_prompt: str | None = None
    chat_template: str | None = None
    renderer: str | None = None  # a Tinker renderer's name (its chat format), for the record

    @classmethod
    def from_dict(cls, raw: Any, rules: ParameterRules | None = None) -> Preset:
        """The preset ``raw`` says, checked; ``PresetError`` naming the first key that does
        not hold. ``rules`` checks the defaults' and clamps' values (None: only their shape)."""
        if not isinstance(raw, dict):
            raise PresetError("preset", "must be an object")
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            raise PresetError(
                f"preset.{unknown[0]}", f"is not a preset key (known: {', '.join(sorted(_KEYS))})"
            )
        for key in ("system_prompt", "user_prompt", "chat_template", "renderer"):
            if raw.get(key) is not None and not isinstance(raw[key], str):
                raise PresetError(f"preset.{key}", "must be a string")
        mode = raw.get("system_prompt_mode") or "default"
        if mode not in SYSTEM_PROMPT_MODES:
            raise PresetError("preset.system_prompt_mode", 'must be "default" or "always"')
        stop = raw.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise PresetError("preset.stop", "must be a string or an array of non-empty strings")
        response_format = raw.get("response_format")
        if response_format is not None and not isinstance(response_format, dict):
            raise PresetError("preset.response_format", "must be an object")
        defaults = _parameters(raw, "defaults", rules)
        clamps = _parameters(raw, "clamps", rules)
        for name, limit in clamps.items():
            if not is_finite_number(limit):
                raise PresetError(f"preset.clamps.{name}", "must be a number (the most allowed)")
            default = defaults.get(name)
            if (
                isinstance(default, int | float)
                and not isinstance(default, bool)
                and default > limit
            ):
                raise PresetError(
                    f"preset.defaults.{name}", f"is {default}, above its clamp {limit}"
                )
        preset = cls(
            system_prompt=raw.get("system_prompt") or None,
            system_prompt_mode=mode,
            defaults=_frozen(defaults),
            clamps=_frozen(clamps),
            stop=tuple(dict.fromkeys(stop)),
            response_format=_frozen(response_format) if response_format else None,
            user_prompt=raw.get("user_prompt") or None,
            chat_template=raw.get("chat_template") or None,
            renderer=raw.get("renderer") or None,
        )
        if len(preset.canonical.encode()) > MAX_PRESET_BYTES:
            raise PresetError("preset", f"is over {MAX_PRESET_BYTES >> 10} KiB as JSON")
        return preset

    def to_dict(self) -> dict[str, Any]:
        """The preset as JSON holds it, without the fields left at their defaults (so two
        presets that behave alike read alike)."""
        record: dict[str, Any] = {}
        if self.system_prompt is not None:
            record["system_prompt"] = self.system_prompt
            if self.system_prompt_mode != "default":
                record["system_prompt_mode"] = self.system_prompt_mode
        for key in ("defaults", "clamps", "response_format"):
            value = getattr(self, key)
            if value:
                record[key] = thawed(value)
        if self.stop:
            record["stop"] = list(self.stop)
        for key in ("user_prompt", "chat_template", "renderer"):
            if getattr(self, key) is not None:
                record[key] = getattr(self, key)
        return record

    @property
    def canonical(self) -> str:
        """Sorted, compact JSON: the same preset gives the same bytes, whoever wrote it."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical.encode()).hexdigest()

    def __bool__(self) -> bool:
        return bool(self.to_dict())


_KEYS = {
    "system_prompt",
    "system_prompt_mode",
    "defaults",
    "clamps",
    "stop",
    "response_format",
    "user_prompt",
    "chat_template",
    "renderer",
}


def _parameters(raw: dict[str, Any], key: str, rules: ParameterRules | None) -> dict[str, Any]:
    values = raw.get(key) or {}
    if not isinstance(values, dict):
        raise PresetError(f"preset.{key}", "must be an object of generation parameters")
    for name, value in values.items():
        where = f"preset.{key}.{name}"
        if value is None:
            raise PresetError(where, "must be a value (leave the parameter out instead of null)")
        if rules is None:
            continue
        try:
            rules(name, value)
        except KeyError:
            raise PresetError(where, "is not a generation parameter a preset can set") from None
        except ValueError as exc:
            raise PresetError(where, str(exc)) from None
        except OverflowError:  # an integer no float holds (``1`` and 400 zeros)
            raise PresetError(where, "is a number too large to use") from None
    return {name: values[name] for name in sorted(values)}


def preset_of_record(record: Any) -> Preset | None:
    """The preset a stored record holds (no value checks: it was checked when stored);
    None for none. ``PresetError`` when the record does not hold one."""
    if record is None:
        return None
    preset = Preset.from_dict(record)
    return preset or None
