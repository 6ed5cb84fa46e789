"""loragate stands on other projects' public interfaces only: no import of another project's
private modules or ``_``-prefixed names, and no class of loragate's that overrides a private
method of another project's class (what broke ``gateway serve`` when uvicorn 0.55 changed
``HttpToolsProtocol._start_asgi_task``). A release of a dependency can then change only what
its authors promise to keep, or say they changed."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "loragate"


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def _modules() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in PACKAGE.rglob("*.py")}


def _foreign(module: str | None) -> bool:
    return module is not None and module.split(".")[0] not in ("loragate", "")


def test_no_module_imports_another_projects_private_names() -> None:
    found = []
    for path, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [
                    (path.name, alias.name)
                    for alias in node.names
                    if _foreign(alias.name) and _private(alias.name)
                ]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and _foreign(node.module):
                assert node.module is not None
                if _private(node.module):
                    found.append((path.name, node.module))
                found += [
                    (path.name, f"{node.module}.{alias.name}")
                    for alias in node.names
                    if _private(alias.name)
                ]
    assert found == []


def _imported_names(tree: ast.Module) -> dict[str, str]:
    """Each name a module binds by importing, to what it names (``module.attr``)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name
    return names


def _resolve(dotted: str) -> object | None:
    module, _, attr = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        try:
            return importlib.import_module(dotted)
        except ImportError:
            return None


def _base_names(base: ast.expr) -> str | None:
    if isinstance(base, ast.Name):
        return base.id
    if isinstance(base, ast.Attribute):
        inner = _base_names(base.value)
        return f"{inner}.{base.attr}" if inner else None
    return None


def test_no_class_overrides_a_private_method_of_another_projects_class() -> None:
    found = []
    checked = 0
    for path, tree in _modules().items():
        imported = _imported_names(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            methods = {
                item.name
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and _private(item.name)
            }
            for base in node.bases:
                name = _base_names(base)
                if name is None:
                    continue
                head, _, rest = name.partition(".")
                if head not in imported:
                    continue
                dotted = imported[head] + (f".{rest}" if rest else "")
                if not _foreign(dotted):
                    continue
                resolved = _resolve(dotted)
                if not isinstance(resolved, type):
                    continue
                checked += 1
                found += [
                    (path.name, node.name, f"{dotted}.{method}")
                    for method in sorted(methods)
                    if hasattr(resolved, method)
                ]
    assert checked >= 5  # the scan sees loragate's subclasses of other projects' classes
    assert found == []


def test_the_scans_catch_what_they_are_for(tmp_path: Path) -> None:
    """The rules above, on the shapes they forbid: a private import and a private override."""
    source = (
        "from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol\n"
        "from starlette._utils import is_async_callable\n"
        "class Guarded(HttpToolsProtocol):\n"
        "    def _start_asgi_task(self): ...\n"
    )
    tree = ast.parse(source)
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert [n.module for n in imports if n.module and _private(n.module)] == ["starlette._utils"]
    imported = _imported_names(tree)
    resolved = _resolve(imported["HttpToolsProtocol"])
    assert isinstance(resolved, type) and hasattr(resolved, "_start_asgi_task")
