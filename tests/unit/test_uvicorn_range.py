"""The hot path and the connection guard on both ends of the uvicorn range pyproject.toml pins.

``gateway/connection_guard.py`` subclasses uvicorn's httptools protocol, which is not public
API, and ``gateway/hot_protocol.py`` that subclass, so loragate pins uvicorn to the releases
this suite runs them on. The installed uvicorn is the range's newest; ``scripts/setup.sh
--test`` puts its oldest in ``.venv/uvicorn-lowest``, and the tests of both run again on that
one here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import uvicorn

from loragate.gateway import connection_guard, hot_protocol

ROOT = Path(__file__).resolve().parents[2]
LOWEST_DIR = Path(sys.prefix) / "uvicorn-lowest"


def pinned_range() -> tuple[tuple[int, ...], tuple[int, ...]]:
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'"uvicorn>=([0-9.]+),<([0-9.]+)"', text)
    assert match, "pyproject.toml no longer pins uvicorn as >=LOW,<HIGH"
    return version(match.group(1)), version(match.group(2))


def version(text: str) -> tuple[int, ...]:
    parts = [int(part) for part in text.split(".")[:3]]
    return tuple(parts + [0] * (3 - len(parts)))


def test_the_installed_uvicorn_is_inside_the_pinned_range_and_fits_the_hot_path() -> None:
    lowest, above = pinned_range()
    assert lowest <= version(uvicorn.__version__) < above
    assert hot_protocol.fits_this_uvicorn() and connection_guard.fits_this_uvicorn()


def test_the_hot_protocol_and_guard_tests_pass_on_the_oldest_uvicorn_of_the_range() -> None:
    lowest, _ = pinned_range()
    found = list(LOWEST_DIR.glob("uvicorn-*.dist-info"))
    assert found, f"no uvicorn in {LOWEST_DIR}: run scripts/setup.sh --test"
    assert version(found[0].name.split("-")[1]) == lowest
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(LOWEST_DIR), str(ROOT)])}
    check = subprocess.run(
        [sys.executable, "-c", "import uvicorn; print(uvicorn.__version__)"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert version(check.stdout.strip()) == lowest
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(ROOT / "tests/unit/test_hot_protocol.py"),
         str(ROOT / "tests/unit/test_connection_hygiene.py")],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
