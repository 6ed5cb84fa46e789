"""loragate's import graph, read from the source: which module imports which.

An import counts wherever it is written: at the top, inside a function, or under
``if TYPE_CHECKING:`` (a type-only import is still a dependency a reader follows, and a circle
through one is still a circle).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "loragate"
LEAVES = {"loragate.http", "loragate.logs", "loragate.paths", "loragate.model_names",
          "loragate.engine_flags", "loragate.periodic", "loragate.engine_states",
          "loragate.systemd"}  # fmt: skip
CONFIG = "loragate.settings"  # a package: ``Settings`` and its field groups


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(path: Path, module: str) -> Iterator[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:  # a submodule, or a name defined in ``source``
                submodule = f"{source}.{alias.name}"
                yield submodule if submodule in MODULES else source


def imports_of(module: str) -> set[str]:
    found = set()
    for name in _imported_names(MODULES[module], module):
        if name.split(".")[0] == "tools":
            found.add("tools")
        elif name.startswith("loragate") and (target := _resolve(name)) not in (None, module):
            found.add(target)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def part(module: str) -> str:
    return ".".join(module.split(".")[:2])


def importers() -> dict[str, set[str]]:
    """Each module's importers inside the package."""
    found: dict[str, set[str]] = defaultdict(set)
    for module, targets in GRAPH.items():
        for target in targets:
            found[target].add(module)
    return found
