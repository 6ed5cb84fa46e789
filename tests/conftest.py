from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from loragate.demo.layout import DEMO_ADAPTERS, ensure_demo

# tools/ (the harness, the stand-in engine, benches) is not installed with the package: the
# processes the tests start (stand-in engines, scripts) import it from this checkout.
CHECKOUT = str(Path(__file__).resolve().parent.parent)
if CHECKOUT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [CHECKOUT, *filter(None, [os.environ.get("PYTHONPATH")])]
    )

PHRASES = {adapter.name: adapter.phrase.strip() for adapter in DEMO_ADAPTERS}


@pytest.fixture(autouse=True)
def logging_as_it_was() -> Iterator[None]:
    """The root logger's handlers and level put back after each test: a command run in
    process (typer's CliRunner) configures logging onto the stderr the runner lends it and
    closes after, and every later record would be a "Logging error" traceback on stderr."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


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
