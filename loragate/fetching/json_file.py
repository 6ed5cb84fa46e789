"""A JSON object read from a file, with an error that names the file and what to do; and
whether a number in one is a float's."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any


def read_json_object(
    path: Path, error: Callable[[str], Exception], hint: str = ""
) -> dict[str, Any]:
    """The JSON object in ``path``; ``error(message)`` is raised when it is not one.

    ``hint`` ends each message (e.g. "; download the run again"). A missing file is the
    caller's to handle: what it means differs (an adapter that is not PEFT, a model that is
    not a Hugging Face directory).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # not UTF-8, not JSON, or an integer past Python's digit limit
        raise error(f"{path} is not valid JSON ({exc}){hint}") from exc
    except RecursionError:
        raise error(f"{path} is nested too deeply to be read{hint}") from None
    if not isinstance(data, dict):
        raise error(f"{path} must hold a JSON object{hint}")
    return data


def is_finite_number(value: Any) -> bool:
    """A number a float holds. JSON as Python reads it takes NaN and Infinity, and integers
    of any length (``1`` and 400 zeros), which no float holds (``math.isfinite`` raises
    ``OverflowError`` on those)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
