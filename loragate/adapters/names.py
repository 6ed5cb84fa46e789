"""Adapter name rules: a public name is a path component, an engine id and a metrics label."""

from __future__ import annotations

import re

MAX_NAME_LENGTH = 64
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class InvalidAdapterName(ValueError):
    pass


def validate_adapter_name(name: str) -> str:
    """Return ``name`` if it is a safe adapter name, else raise with the rule spelled out."""
    if not name or len(name) > MAX_NAME_LENGTH or not _NAME.fullmatch(name) or ".." in name:
        raise InvalidAdapterName(
            f"invalid adapter name {name!r}: use 1-{MAX_NAME_LENGTH} characters from "
            "A-Z a-z 0-9 . _ -, starting with a letter or digit, and no '..'"
        )
    return name
