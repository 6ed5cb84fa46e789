"""Each module holds a whole idea: not over about 600 lines (past that it holds more than one),
and not a slice of its one importer.

The floor: a module under about 50 lines that only one other module of the package imports
lives in that importer, unless it is one of four kinds a small file is a choice for: a process
entry point (``__main__``, or run with ``python -m``), an interchangeable implementation (one
of several behind one interface), a public seam (what users or other tools import), or a public
value type. ``EXEMPT`` names each such module with its kind, and nothing else.
"""

from __future__ import annotations

from pathlib import Path

from tests.import_graph import MODULES, importers

CEILING = 600
FLOOR = 50
KINDS = {"entry point", "interchangeable implementation", "public seam", "public value type"}
EXEMPT: dict[str, str] = {
    "loragate.__main__": "entry point",
    "loragate.adapters.intake.convert.__main__": "entry point",
    "loragate.engine_plugin.__main__": "entry point",
}


def lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_module_is_over_the_ceiling() -> None:
    sizes = {module: lines(path) for module, path in MODULES.items()}
    assert len(sizes) > 100  # the whole package was read
    over = {module: n for module, n in sorted(sizes.items()) if n > CEILING}
    assert not over, f"modules over {CEILING} lines (split them by responsibility): {over}"


def test_no_small_module_is_a_slice_of_its_only_importer() -> None:
    users = importers()
    slices = {
        module: sorted(users[module])
        for module, path in sorted(MODULES.items())
        if path.name != "__init__.py"
        and lines(path) < FLOOR
        and len(users[module]) <= 1
        and module not in EXEMPT
    }
    assert not slices, (
        f"modules under {FLOOR} lines with at most one importer (fold each into its importer, "
        f"or name its kind in EXEMPT): {slices}"
    )


def test_the_exemptions_are_of_the_four_kinds_and_still_needed() -> None:
    assert set(EXEMPT.values()) <= KINDS
    assert len(EXEMPT) <= 8, "more exemptions than small files by choice: fold some"
    users = importers()
    stale = [
        module
        for module in EXEMPT
        if module not in MODULES or lines(MODULES[module]) >= FLOOR or len(users[module]) > 1
    ]
    assert not stale, f"EXEMPT names modules the floor no longer catches: {stale}"
