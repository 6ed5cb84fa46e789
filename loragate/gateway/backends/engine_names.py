"""Engine ids back to public names, in answers whose request named no model.

An answer to ``GET /v1/responses/{id}`` carries whatever adapter version served the response
(``fox@0123456789ab``), which may since have been swapped out: every version id, current or
not, goes back to its public name, and the zero adapter's (base requests on the CPU build)
to the base model's.
"""

from __future__ import annotations

import re

from loragate.gateway.proxy import Rename

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
