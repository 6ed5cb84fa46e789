"""Engine ids back to public names in what the engine says.

The engine serves each adapter version under its own id (``fox@0123456789ab``) and, on the CPU
build, base requests under the zero adapter's; clients and metrics see public names (``fox``,
the base model's). ``Rename`` rewrites one id in an answer; ``AnyVersionRename`` every version
id, current or not (an answer to ``GET /v1/responses/{id}`` carries whatever version served it,
which may since have been swapped out), and the base's engine id to the base name.
"""

from __future__ import annotations

import re
from functools import lru_cache


class Rename:
    """Rewrite engine id ``internal`` to ``public`` in answers."""

    __slots__ = ("_field_from", "_field_to", "internal", "public")

    def __init__(self, internal: bytes, public: bytes) -> None:
        self.internal = internal
        self.public = public
        self._field_from = b'"model":"' + internal + b'"'
        self._field_to = b'"model":"' + public + b'"'

    @classmethod
    @lru_cache(maxsize=256)
    def of(cls, internal: str, public: str) -> Rename | None:
        if internal == public:
            return None
        return cls(internal.encode(), public.encode())

    def model_field(self, data: bytes) -> bytes:
        return data.replace(self._field_from, self._field_to)

    def everywhere(self, data: bytes) -> bytes:
        return data.replace(self.internal, self.public)


# Every version id, for answers whose request named no model, and the engine's metrics.
_MODEL_FIELD = re.compile(rb'"model":"(([^"\\@]+)@[0-9a-f]{12})"')
_ANYWHERE = re.compile(rb"(([A-Za-z0-9_][A-Za-z0-9._-]*)@[0-9a-f]{12})\b")


class AnyVersionRename(Rename):
    """Every ``NAME@VERSION`` engine id to ``NAME``; the base's engine id to the base name."""

    __slots__ = ("_base_id",)

    def __init__(self, base_engine_id: str, base_name: str) -> None:
        super().__init__(base_engine_id.encode(), base_name.encode())
        self._base_id = base_engine_id.encode()

    def model_field(self, data: bytes) -> bytes:
        return _MODEL_FIELD.sub(self._field, data)

    def everywhere(self, data: bytes) -> bytes:
        return _ANYWHERE.sub(self._name, data)

    def _field(self, match: re.Match[bytes]) -> bytes:
        return b'"model":"' + self._name(match) + b'"'

    def _name(self, match: re.Match[bytes]) -> bytes:
        return self.public if match.group(1) == self._base_id else match.group(2)
