"""A JSON object read from a file, with an error that names the file and what to do."""

from __future__ import annotations

import json
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
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{path} is not valid JSON ({exc}){hint}") from exc
    if not isinstance(data, dict):
        raise error(f"{path} must hold a JSON object{hint}")
    return data
