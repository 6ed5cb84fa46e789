"""No module of the package over 600 lines: past that, a module holds more than one idea.

The house plan (docs/architecture.md) splits by responsibility; this keeps it that way.
"""

from __future__ import annotations

from pathlib import Path

import loragate

LIMIT = 600
PACKAGE = Path(loragate.__file__).resolve().parent


def test_no_module_is_over_the_limit() -> None:
    sizes = {
        str(path.relative_to(PACKAGE.parent)): len(path.read_text(encoding="utf-8").splitlines())
        for path in PACKAGE.rglob("*.py")
    }
    assert len(sizes) > 100  # the whole package was read
    over = {name: lines for name, lines in sorted(sizes.items()) if lines > LIMIT}
    assert not over, f"modules over {LIMIT} lines (split them by responsibility): {over}"
