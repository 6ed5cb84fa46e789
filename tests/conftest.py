from __future__ import annotations

from pathlib import Path

import pytest

from loragate.demo.layout import DEMO_ADAPTERS, ensure_demo

PHRASES = {adapter.name: adapter.phrase.strip() for adapter in DEMO_ADAPTERS}


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    """The bundled demo (tiny base model + phrase adapters), built once and cached."""
    return ensure_demo()


def phrase_of(text: str) -> str | None:
    """Which demo adapter's phrase ``text`` carries, if any."""
    for name, phrase in PHRASES.items():
        if phrase in text:
            return name
    return None
