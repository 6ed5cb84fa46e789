"""docs/architecture.md names only paths that exist: a house plan that points at moved or
deleted rooms misleads the next reader more than none."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
# `a/b.py`, `dir/`, `name.py`: a backticked token with a slash or a .py/.md suffix.
PATHLIKE = re.compile(r"`([\w./-]+(?:/|\.py|\.md))`")


def named_paths(text: str) -> set[str]:
    return {token for token in PATHLIKE.findall(text) if not token.startswith(("http", "--"))}


def exists(token: str, text: str) -> bool:
    """A path from the root, from loragate/, or a file in a package the doc names nearby."""
    candidates = [ROOT / token, ROOT / "loragate" / token]
    candidates += [ROOT / "loragate" / package / token for package in _packages()]
    return any(candidate.exists() for candidate in candidates)


def _packages() -> list[str]:
    package_root = ROOT / "loragate"
    return [
        str(path.parent.relative_to(package_root))
        for path in package_root.rglob("__init__.py")
        if path.parent != package_root
    ]


def test_every_path_the_architecture_doc_names_exists() -> None:
    text = DOC.read_text()
    paths = named_paths(text)
    assert len(paths) > 40  # the doc names its rooms
    missing = sorted(token for token in paths if not exists(token, text))
    assert missing == [], f"docs/architecture.md names paths that do not exist: {missing}"


def test_the_architecture_doc_stays_short() -> None:
    assert len(DOC.read_text().splitlines()) <= 170
