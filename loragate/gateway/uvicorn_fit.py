"""What the fast path and the connection guard need of uvicorn's internals, and whether the
installed uvicorn has it.

``connection_guard`` subclasses uvicorn's httptools protocol and ``hot_protocol`` that
subclass; neither is public API, and uvicorn changes it between releases (0.53 made
``_start_asgi_task`` honour ``config.reset_contextvars``). So nothing here assumes a
release: the internals are imported behind a guard (importing the gateway never fails,
whatever uvicorn is installed, or none of its httptools protocol), and ``server_options``
asks two questions before it serves:

- ``guard_unfit()``: can the guard hook in? It extends uvicorn's protocol (each override
  calls uvicorn's own method), so what it needs is structure, checked on the code objects
  (no source needed): the protocol and its callbacks exist, every request is started through
  ``_start_asgi_task`` (from ``on_headers_complete`` and, pipelined, ``on_response_complete``:
  that is where the guard admits requests), a parse error still goes to
  ``send_400_response``, and the attributes it reads are still set. If not, ``gateway serve``
  refuses to start (``UnfitUvicorn``): the deadlines and budgets are its defence against
  slow and idle clients, and serving without them is not a fallback to take silently.
- ``fast_path_unfit()``: may the fast path run? It does not only extend uvicorn, it stands
  in for some of it: its ``start_request`` for ``_start_asgi_task``, its answers for
  ``RequestResponseCycle.send`` and ``run_asgi``, and it relies on ``receive`` and on the
  guard's pieces. A feature check cannot see a change in what those do (the
  ``reset_contextvars`` drift had the same names and signatures), so each piece is
  fingerprinted: a hash of its source's syntax tree, which ignores comments, docstrings
  and formatting but not one changed expression, compared with the fingerprints of the
  releases the suite ran the fast path on (``KNOWN``). One piece that differs, or whose
  source cannot be read, and the fast path refuses this uvicorn: every route goes through
  plain ASGI (slower, the same answers), behind the guard if ``guard_unfit()`` allows.

The tree is printed with every field but the empty ones (``None``, ``[]``), so one source
gives one fingerprint on each Python version whose ``ast`` gained only optional fields
(``type_params`` in 3.12). To accept a new uvicorn release: read what changed in the pieces
below against ``hot_protocol`` and ``connection_guard``, follow it there, then add what
``python -m loragate.gateway.uvicorn_fit`` prints to ``KNOWN``;
``tests/unit/test_uvicorn_range.py`` checks the oldest, the installed and the newest
uvicorn against it.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import textwrap
from typing import TYPE_CHECKING, Any


def _internals() -> tuple[Any, Any, Any, str | None]:
    """uvicorn's httptools protocol, request cycle and status lines, and None; or stand-ins
    and why they could not be imported."""
    try:
        from uvicorn.protocols.http import httptools_impl as module

        return module.HttpToolsProtocol, module.RequestResponseCycle, module.STATUS_LINE, None
    except Exception as exc:  # any uvicorn (or none): the gateway must still import
        import asyncio

        return asyncio.Protocol, None, {}, f"{type(exc).__name__}: {exc}"


_LOADED = _internals()
_MISSING: str | None = _LOADED[3]
if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import (
        STATUS_LINE,
        HttpToolsProtocol,
        RequestResponseCycle,
    )
else:
    HttpToolsProtocol, RequestResponseCycle, STATUS_LINE = _LOADED[:3]

try:
    from uvicorn import __version__ as UVICORN_VERSION
except Exception:  # pragma: no cover - no uvicorn at all
    UVICORN_VERSION = "none"

GUARD_CALLBACKS = (
    "connection_made",
    "connection_lost",
    "data_received",
    "pause_writing",
    "resume_writing",
    "on_message_begin",
    "on_headers_complete",
    "on_body",
    "on_message_complete",
    "on_response_complete",
    "send_400_response",
    "_start_asgi_task",
)
"""The protocol methods ``GuardedProtocol`` overrides or relies on being called."""

PROTOCOL_ATTRIBUTES = frozenset(
    {"config", "app", "loop", "parser", "tasks", "server_state", "transport", "flow"}
    | {"client", "headers", "cycle"}
)
"""What the guard and the fast path read of a protocol, set by its ``__init__`` or
``connection_made``."""

FAST_PATH_PIECES = (
    "HttpToolsProtocol._start_asgi_task",
    "RequestResponseCycle.__init__",
    "RequestResponseCycle.run_asgi",
    "RequestResponseCycle.send",
    "RequestResponseCycle.receive",
)
"""What the fast path stands in for or drives, besides the guard's callbacks."""

TESTED_ON = ("0.53.0", "0.54.0")
"""The uvicorn releases whose pieces' fingerprints are in ``KNOWN``."""

KNOWN: dict[str, frozenset[str]] = {
    # 0.53.0 and 0.54.0 (their httptools protocol is the same)
    "HttpToolsProtocol.connection_made": frozenset({"96fe5d4704961338"}),
    "HttpToolsProtocol.connection_lost": frozenset({"2638ea7a0baac652"}),
    "HttpToolsProtocol.data_received": frozenset({"9e65c24ed367e9cc"}),
    "HttpToolsProtocol.pause_writing": frozenset({"e5eb0ac56b723026"}),
    "HttpToolsProtocol.resume_writing": frozenset({"2f20da3e13f5ad94"}),
    "HttpToolsProtocol.on_message_begin": frozenset({"de7e9ed00e7d6be0"}),
    "HttpToolsProtocol.on_headers_complete": frozenset({"b627468a48362fad"}),
    "HttpToolsProtocol.on_body": frozenset({"1030e8c24e579408"}),
    "HttpToolsProtocol.on_message_complete": frozenset({"7967354253b9927a"}),
    "HttpToolsProtocol.on_response_complete": frozenset({"b890830ea33f6fd2"}),
    "HttpToolsProtocol.send_400_response": frozenset({"349e8746a769cfde"}),
    "HttpToolsProtocol._start_asgi_task": frozenset({"b23b0a0083b14149"}),
    "RequestResponseCycle.__init__": frozenset({"19bab73c923e1254"}),
    "RequestResponseCycle.run_asgi": frozenset({"fbe5ab4776811df4"}),
    "RequestResponseCycle.send": frozenset({"bc8fb9ce022d42e6"}),
    "RequestResponseCycle.receive": frozenset({"b5d32eeb4e945822"}),
}
"""Each piece's fingerprints (``fingerprint``) on the releases in ``TESTED_ON``."""


class UnfitUvicorn(RuntimeError):
    """The installed uvicorn cannot carry the connection guard: ``gateway serve`` refuses."""


def pieces() -> dict[str, Any]:
    """Every piece the fast path depends on (the guard's callbacks among them), by name."""
    found: dict[str, Any] = {}
    for name in GUARD_CALLBACKS:
        found[f"HttpToolsProtocol.{name}"] = getattr(HttpToolsProtocol, name, None)
    for name in FAST_PATH_PIECES:
        owner, attribute = name.split(".")
        found[name] = getattr({"HttpToolsProtocol": HttpToolsProtocol,
                               "RequestResponseCycle": RequestResponseCycle}[owner],
                              attribute, None)  # fmt: skip
    return found


def guard_unfit() -> str | None:
    """Why ``connection_guard`` cannot hook into this uvicorn, or None when it can."""
    if _MISSING is not None:
        return f"its httptools protocol does not import ({_MISSING})"
    if not all(code in STATUS_LINE for code in range(100, 600)):
        return "its httptools protocol has no STATUS_LINE table"
    missing = [
        name for name in GUARD_CALLBACKS if not callable(getattr(HttpToolsProtocol, name, None))
    ]
    if missing:
        return f"HttpToolsProtocol has no {', '.join(missing)}"
    for name in ("on_headers_complete", "on_response_complete"):
        if "_start_asgi_task" not in _names_used(getattr(HttpToolsProtocol, name)):
            return f"HttpToolsProtocol.{name} no longer starts requests through _start_asgi_task"
    if "send_400_response" not in _names_used(HttpToolsProtocol.data_received):
        return (
            "HttpToolsProtocol.data_received no longer answers parse errors with send_400_response"
        )
    set_up = _names_used(HttpToolsProtocol.__init__) | _names_used(
        HttpToolsProtocol.connection_made
    )
    unset = sorted(PROTOCOL_ATTRIBUTES - set_up)
    if unset:
        return f"HttpToolsProtocol no longer sets {', '.join(unset)}"
    return None


def fast_path_unfit() -> str | None:
    """Why the fast path refuses this uvicorn, or None when every piece is one it was run on."""
    unfit = guard_unfit()
    if unfit is not None:
        return unfit
    if RequestResponseCycle is None:  # pragma: no cover - guard_unfit saw the import fail
        return "it has no RequestResponseCycle"
    changed = [name for name, function in pieces().items()
               if function is None or fingerprint(function) not in KNOWN.get(name, ())]  # fmt: skip
    if changed:
        return (
            f"{', '.join(changed)} differ{'s' if len(changed) == 1 else ''} from the releases "
            f"the fast path was checked on (uvicorn {', '.join(TESTED_ON)})"
        )
    return None


@functools.lru_cache(maxsize=64)
def fingerprint(function: Any) -> str | None:
    """A hash of ``function``'s syntax tree (comments, docstring and layout left out), or None
    when its source cannot be read."""
    try:
        definition = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    if isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)):
        definition.name = ""  # the piece is known by the name it is looked up by
    return hashlib.sha256(_shape(definition).encode()).hexdigest()[:16]


def _shape(node: Any) -> str:
    if isinstance(node, list):
        return "[" + ",".join(_shape(item) for item in node) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    fields = []
    for name, value in ast.iter_fields(node):
        if name == "body" and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            value = _without_docstring(value)
        if value is None or value == [] or name == "type_comment":
            continue
        fields.append(f"{name}={_shape(value)}")
    return f"{type(node).__name__}({','.join(fields)})"


def _without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        return body[1:] if isinstance(first.value.value, str) else body
    return body


def _names_used(function: Any) -> set[str]:
    """The global and attribute names ``function``'s code reads, writes or calls."""
    code = getattr(function, "__code__", None)
    return set(code.co_names) if code is not None else set()


if __name__ == "__main__":
    print(f"# uvicorn {UVICORN_VERSION}")
    for piece, function in pieces().items():
        print(f'    "{piece}": frozenset({{"{fingerprint(function) if function else None}"}}),')
