"""The house plan's import rules, read from the source: no cycles, one direction.

gateway -> adapters -> supervisor (the engine); the configuration leaves (the ``settings``
package, its modules importing only each other and what they read: ``engine_flags``,
``model_names``, ``paths``), the ``http`` package (the one HTTP/1.1 client: its modules import
only each other) and ``logs`` import nothing else of loragate; ``cli`` and the app factory sit
on top; ``demo`` may use adapters and the supervisor, not the gateway; the engine plugin is a
leaf that no other part imports; the installed package never imports the checkout's
``tools``. An import counts wherever it is written (inside a function too), except under
``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "loragate"
LEAVES = {"loragate.http", "loragate.logs", "loragate.paths", "loragate.model_names",
          "loragate.engine_flags"}  # fmt: skip
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
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
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


def test_there_are_no_import_cycles_in_loragate() -> None:
    cycles = []
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in GRAPH[module] & MODULES.keys():
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(MODULES):
        if module not in index:
            visit(module)
    assert cycles == []


def test_imports_go_gateway_to_adapters_to_the_supervisor_never_back() -> None:
    forbidden = {
        "loragate.adapters": {"loragate.gateway", "loragate.cli"},
        "loragate.supervisor": {"loragate.gateway", "loragate.adapters", "loragate.demo"},
        "loragate.demo": {"loragate.gateway", "loragate.cli"},
        "loragate.engine_plugin": {"loragate.gateway", "loragate.adapters", "loragate.cli"},
    }
    wrong = sorted(
        (module, target)
        for module, targets in GRAPH.items()
        for target in targets
        if part(target) in forbidden.get(part(module), set())
    )
    assert wrong == []


def leaf_of(module: str) -> str | None:
    """The leaf (a module, or a package with its modules) that ``module`` belongs to."""
    return next((leaf for leaf in LEAVES if module == leaf or module.startswith(leaf + ".")), None)


def test_the_configuration_and_the_leaves_import_nothing_above_them() -> None:
    config = {module for module in MODULES if part(module) == CONFIG}
    assert {
        (m, t) for m in config for t in GRAPH[m] if leaf_of(t) is None and t not in config
    } == set()
    outside = {
        module: {t for t in targets if leaf_of(t) != leaf_of(module)}
        for module, targets in GRAPH.items()
        if leaf_of(module) is not None
    }
    assert {module: targets for module, targets in outside.items() if targets} == {}
    assert "loragate.http.wire" in GRAPH["loragate.http.pool"]  # the package's modules are seen


def test_nothing_imports_the_cli_the_engine_plugin_or_the_checkouts_tools() -> None:
    assert [m for m, targets in GRAPH.items() if "loragate.cli" in targets] == []
    cli_parts = {m for m in MODULES if m.startswith("loragate.cli_")}  # cli_serve, cli_admin...
    cli = cli_parts | {"loragate.cli"}
    assert [m for m, targets in GRAPH.items() if targets & cli_parts and m not in cli] == []
    plugin_users = [
        m
        for m, targets in GRAPH.items()
        if part(m) != "loragate.engine_plugin"
        and any(part(t) == "loragate.engine_plugin" for t in targets)
    ]
    assert plugin_users == []
    assert [m for m, targets in GRAPH.items() if "tools" in targets] == []
    app_users = {m for m, targets in GRAPH.items() if "loragate.gateway.app" in targets}
    assert app_users <= {"loragate.cli_serve", "loragate"}, app_users


def test_the_graph_is_read_at_all() -> None:
    # A parser that found nothing would pass every rule above.
    assert len(MODULES) > 80
    assert "loragate.adapters.manager" in GRAPH["loragate.gateway.backends.supervised"]
    assert "loragate.supervisor.engine" in GRAPH["loragate.adapters.manager"]
