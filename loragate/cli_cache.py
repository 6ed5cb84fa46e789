"""``gateway cache ...``: what the cache dir holds, with sizes and what uses each item (as
``ollama list`` and ``docker system df`` show theirs), and removing what nothing uses (as
``ollama rm`` and ``docker image prune`` do), never what an adapter manifest or a running
gateway serves.

Where a gateway runs on the cache dir, what it serves is asked of its admin API (``--url``,
``--admin-key``), once its lock's pid is known to be the server at that URL; where that cannot
be asked, or the gateway is adding an adapter or starting a model, nothing is removed and the
error says what to do. Where none runs, the gateway lock is held while items are removed, so
that none starts meanwhile (``loragate.cache``)."""

from __future__ import annotations

import contextlib
import json
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from loragate.cli_admin import (
    DEFAULT_URL,
    AdminKeyOption,
    UrlOption,
    error_answer,
    local_admin_token,
    unreachable,
)
from loragate.cli_errors import FAILURE, fail, warn
from loragate.cli_help import PlainCommand, plain_typer
from loragate.cli_tables import GAP, beneath, terminal_width

if TYPE_CHECKING:  # imported with the commands: the CLI starts without them
    from loragate.cache.contents import CacheItem, GatewayServes, Inventory

_SHORTEST_PREFIX = 6  # of a version's sha256, to name it
_LONG_NAME = 28  # a repo id as long as Qwen/Qwen2.5-1.5B-Instruct still fits the column
_NARROWEST = 16  # for the USED BY column, else it goes beneath its row

CacheDirOption = Annotated[
    Path | None,
    typer.Option(
        "--cache-dir",
        envvar="LORAGATE_CACHE_DIR",
        metavar="PATH",
        help="The cache dir (default: ~/.cache/loragate; under systemd, $CACHE_DIRECTORY).",
    ),
]
StateDirOption = Annotated[
    Path | None,
    typer.Option(
        "--state-dir",
        envvar="LORAGATE_STATE_DIR",
        metavar="PATH",
        help="Where the gateway keeps its adapter manifests, as `gateway serve --state-dir` "
        "(default: $STATE_DIRECTORY under systemd, else the cache dir).",
    ),
]


@dataclass
class _Where:
    cache_dir: Path
    state_dir: Path
    url: str
    admin_key: str | None


@dataclass
class _View:
    """An inventory, and what the gateways running on the cache dir said (or why not)."""

    inventory: Inventory
    running: dict[Path, int]
    asked: dict[int, GatewayServes] = field(default_factory=dict)
    unasked: dict[int, str] = field(default_factory=dict)  # pid -> why not
    untried: dict[Path, str] = field(default_factory=dict)  # scope -> why its lock was not tried

    def refusals(self) -> list[str]:
        """Why nothing may be removed now, each with what to do; none: go ahead."""
        found = [f"{why}; nothing was removed" for why in self.inventory.problems]
        for pid, why in self.unasked.items():
            found.append(
                f"gateway {pid} runs on {self.scopes_of(pid)} but could not be asked what it "
                f"serves: {why}; or stop it first"
            )
        for pid, answer in self.asked.items():
            found += [f"gateway {pid}: {busy}; try again once it is done" for busy in answer.busy]
        for scope, why in self.untried.items():
            found.append(
                f"cannot tell whether a gateway runs on {scope} ({why}): run this as the cache "
                "dir's owner"
            )
        return found

    def scopes_of(self, pid: int) -> str:
        return ", ".join(str(scope) for scope, held in self.running.items() if held == pid)


cache_app = plain_typer(
    help="What the cache dir holds (base models, GGUF conversions, adapter versions, logs), "
    "with sizes and what uses each; remove what nothing uses.",
    invoke_without_command=True,
)


@cache_app.callback()
def _cache(ctx: typer.Context) -> None:
    """What the cache dir holds (base models, GGUF conversions, adapter versions, logs), with
    sizes and what uses each; remove what nothing uses. Alone: `gateway cache list`."""
    if ctx.invoked_subcommand is None:
        command = ctx.command.get_command(ctx, "list")  # type: ignore[attr-defined]
        with command.make_context("list", [], parent=ctx) as listing:
            command.invoke(listing)


@cache_app.command("list", cls=PlainCommand)
def cache_list(
    cache_dir: CacheDirOption = None,
    state_dir: StateDirOption = None,
    url: UrlOption = DEFAULT_URL,
    admin_key: AdminKeyOption = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print every item and the totals as JSON, for scripts.")
    ] = False,
) -> None:
    """Every item of the cache dir with its kind, size and what uses it: an adapter's live or
    rollback version, the base model of recorded adapters, a running gateway or process.

    Base models in the Hugging Face cache are listed too. A gateway running on the cache dir
    is asked what it serves at --url."""
    where = _where(cache_dir, state_dir, url, admin_key)
    view = _look(where)
    if as_json:
        typer.echo(json.dumps(_report(where, view), indent=2))
        return
    width = terminal_width()
    typer.echo(cache_table(view, where.url, width), nl=False)


@cache_app.command("remove", cls=PlainCommand)
def cache_remove(
    names: Annotated[
        list[str],
        typer.Argument(
            metavar="NAME",
            help="An item as `gateway cache list` names it (a version also by a prefix of its "
            "sha256), or its path.",
        ),
    ],
    cache_dir: CacheDirOption = None,
    state_dir: StateDirOption = None,
    url: UrlOption = DEFAULT_URL,
    admin_key: AdminKeyOption = None,
) -> None:
    """Remove the items named, each only if nothing uses it (a base model in the Hugging Face
    cache and the logs too); refused, with nothing removed, if one is in use."""
    where = _where(cache_dir, state_dir, url, admin_key)
    with _holding(where) as view:
        chosen = list({id(item): item for item in (_find(view, name) for name in names)}.values())
        used = [item for item in chosen if item.used_by]
        if used:
            fail(
                "; ".join(f"{_label(i)} is in use by {', '.join(i.used_by)}" for i in used)
                + ": nothing was removed (an adapter's versions are freed by `gateway adapters "
                "remove NAME`, a model by stopping the gateway that serves it)",
                FAILURE,
            )
        _refuse_if_not_clear(view)
        _remove(view.inventory, chosen, dry_run=False)


@cache_app.command("prune", cls=PlainCommand)
def cache_prune(
    cache_dir: CacheDirOption = None,
    state_dir: StateDirOption = None,
    url: UrlOption = DEFAULT_URL,
    admin_key: AdminKeyOption = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what would be removed, remove nothing.")
    ] = False,
) -> None:
    """Remove every item nothing uses: adapter versions no manifest or gateway serves, GGUF
    conversions and old downloads of no served model, leftovers of work cut short.

    Never the logs nor the Hugging Face cache (`gateway cache remove` takes those by name)."""
    where = _where(cache_dir, state_dir, url, admin_key)
    with _holding(where) as view:
        _refuse_if_not_clear(view)
        chosen = view.inventory.prunable()
        if not chosen:
            typer.echo("nothing to prune: every item is in use")
            return
        _remove(view.inventory, chosen, dry_run=dry_run)


# ----- looking -----------------------------------------------------------------------------


def _where(cache_dir: Path | None, state_dir: Path | None, url: str, key: str | None) -> _Where:
    from loragate.paths import default_cache_dir, default_state_dir

    cache = (cache_dir or default_cache_dir()).expanduser().resolve()
    state = (state_dir or default_state_dir() or cache).expanduser().resolve()
    return _Where(cache, state, url, key if key is not None else local_admin_token(url, cache))


def _look(where: _Where) -> _View:
    """The inventory with the gateways' answers; the locks are only tried (a listing never
    keeps a gateway from starting)."""
    from loragate.cache.contents import gateway_scopes
    from loragate.cache.holders import scope_locks

    if not where.cache_dir.is_dir():  # the Hugging Face cache may still hold models
        return _view(where, {}, {})
    with scope_locks(gateway_scopes(where.cache_dir)) as locks:
        pass
    return _view(where, locks.running, locks.untried)


@contextlib.contextmanager
def _holding(where: _Where) -> Iterator[_View]:
    """The inventory taken with every free scope's gateway lock held, so that no gateway starts
    on the cache dir until the removal is done."""
    from loragate.cache.contents import gateway_scopes
    from loragate.cache.holders import scope_locks

    if not where.cache_dir.is_dir():
        fail(f"there is no cache dir {where.cache_dir}: nothing to remove", FAILURE)
    with scope_locks(gateway_scopes(where.cache_dir)) as locks:
        yield _view(where, locks.running, locks.untried)


def _view(where: _Where, running: dict[Path, int], untried: dict[Path, str]) -> _View:
    from loragate.base_model.hub_cache import hub_cache_dir
    from loragate.cache.contents import take_inventory

    asked: dict[int, GatewayServes] = {}
    unasked: dict[int, str] = {}
    for pid in sorted(set(running.values())):
        try:
            asked[pid] = _ask(where, pid)
        except _Unasked as exc:
            unasked[pid] = str(exc)
    hub = hub_cache_dir()
    inventory = take_inventory(
        where.cache_dir, where.state_dir, hub if hub.is_dir() else None, asked.values(), running
    )
    return _View(inventory, dict(running), asked, unasked, dict(untried))


class _Unasked(Exception):
    pass


def _ask(where: _Where, pid: int) -> GatewayServes:
    """What gateway ``pid`` serves, asked at ``--url`` once it is known to be the server
    there: its adapters' versions, its models, and what it is busy with."""
    from loragate.cache.contents import GatewayServes
    from loragate.cache.holders import listens_on

    if pid <= 0:
        raise _Unasked("its lock file does not name its process")
    listening = listens_on(pid, where.url)
    if listening is None:
        raise _Unasked("its sockets cannot be seen from this user: run this as the gateway's")
    if not listening:
        raise _Unasked(
            f"it is not the gateway at {where.url}: pass its address with --url (and its "
            "--admin-key)"
        )
    adapters = _admin_get(where, "/admin/adapters")
    models = _admin_get(where, "/admin/models")
    catalog = "base_models" in adapters
    versions: dict[str, list[str]] = {}
    for row in adapters.get("data") or []:
        name = f"{row.get('base_model')}/{row.get('name')}" if catalog else str(row.get("name"))
        for key, role in (("version", "live"), ("previous_version", "rollback")):
            if isinstance(row.get(key), str):
                versions.setdefault(row[key], []).append(f"{name} ({role})")
    busy = [
        f"an add of {record.get('name')} is under way"
        for record in adapters.get("progress") or []
        if isinstance(record, dict) and not record.get("finished")
    ]
    served: dict[str, str | None] = {}
    for model in models.get("models") or []:
        served[str(model.get("id"))] = model.get("model")
        if model.get("residency") == "loading":
            busy.append(f"model {model.get('id')} is starting (its adapters are being prepared)")
    return GatewayServes(pid, versions, served, busy)


def _admin_get(where: _Where, path: str) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {where.admin_key}"} if where.admin_key else {}
    try:
        # The admin key goes to the gateway itself, never to an HTTP(S)_PROXY from the env.
        with httpx.Client(timeout=30, trust_env=False) as client:
            response = client.get(where.url.rstrip("/") + path, headers=headers)
    except httpx.HTTPError as exc:
        raise _Unasked(unreachable(where.url, exc)) from None
    if response.status_code >= 400:
        raise _Unasked(f"its {path} answered {error_answer(response)}")
    try:
        payload = response.json()
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        raise _Unasked(f"its {path} answered no JSON object")
    return payload


# ----- removing ----------------------------------------------------------------------------


def _find(view: _View, name: str) -> CacheItem:
    """The item ``name`` names: its name, its path, or (a version) a prefix of its sha256."""
    import re

    items = view.inventory.items
    found = [i for i in items if name in (i.name, str(i.path))]
    if not found:
        with_path = Path(name).expanduser()
        found = [i for i in items if with_path.is_absolute() and i.path == with_path.resolve()]
    prefix = re.fullmatch(rf"(?:([^/]+)/)?([0-9a-f]{{{_SHORTEST_PREFIX},64}})", name)
    if not found and prefix:
        model, digest = prefix.groups()
        found = [
            i
            for i in items
            if i.kind == "adapter_version"
            and i.path.name.startswith(digest)
            and (model is None or i.name.startswith(f"{model}/"))
        ]
    if not found:
        fail(f"the cache holds no item {name!r} (`gateway cache list` names each)", FAILURE)
    if len(found) > 1:
        paths = ", ".join(str(i.path) for i in found)
        fail(f"{name!r} names {len(found)} items ({paths}): name one by its path", FAILURE)
    return found[0]


def _refuse_if_not_clear(view: _View) -> None:
    refusals = view.refusals()
    if refusals:
        from loragate.cli_errors import fail_each

        fail_each(refusals, FAILURE)


def _remove(inventory: Inventory, chosen: list[CacheItem], dry_run: bool) -> None:
    from loragate.cache.contents import CacheBusy, remove_item

    freed = inventory.freed_by(chosen)
    if dry_run:
        for item in chosen:
            typer.echo(f"would remove {_label(item)} ({human_size(item.size)})")
        typer.echo(f"would free {human_size(freed)}")
        return
    kept: list[CacheItem] = []
    for item in chosen:
        try:
            remove_item(item)
        except (CacheBusy, OSError) as exc:
            warn(f"kept {_label(item)}: {exc}")
            kept.append(item)
            continue
        typer.echo(f"removed {_label(item)} ({human_size(item.size)})")
    if len(kept) < len(chosen):
        done = [item for item in chosen if item not in kept]
        typer.echo(f"freed {human_size(inventory.freed_by(done))}")
    if kept:
        raise typer.Exit(FAILURE)


def _label(item: CacheItem) -> str:
    from loragate.cache.contents import KIND_WORDS

    kind = KIND_WORDS[item.kind]
    return item.name if item.name == kind else f"{kind} {item.name}"


# ----- showing -----------------------------------------------------------------------------


def _report(where: _Where, view: _View) -> dict[str, Any]:
    """`gateway cache list --json`: the items, the totals, the gateways and manifests read."""
    inventory = view.inventory
    prunable = inventory.prunable()
    return {
        "cache_dir": str(where.cache_dir),
        "state_dir": str(where.state_dir),
        "items": [item.as_dict() for item in inventory.items],
        "total_bytes": inventory.bytes_of(inventory.items),
        "prunable_bytes": inventory.freed_by(prunable),
        "gateways": [
            {
                "pid": pid,
                "cache_dirs": [str(s) for s, held in view.running.items() if held == pid],
                "asked": pid in view.asked,
                "reason": view.unasked.get(pid),
                "busy": view.asked[pid].busy if pid in view.asked else [],
            }
            for pid in sorted(set(view.running.values()))
        ],
        "manifests": [str(path) for path in inventory.manifests],
        "problems": inventory.problems,
    }


def cache_table(view: _View, url: str, width: int = 80) -> str:
    """The items in aligned columns (KIND, NAME, SIZE, USED BY), what it used to be beneath
    each unused item, a total, then what the gateways on the cache dir said, or why not."""
    from loragate.cache.contents import KIND_WORDS

    inventory = view.inventory
    if not inventory.items:
        lines = [f"the cache dir {inventory.cache_dir} holds nothing"]
        return "\n".join(lines + _notes(view, url, width)) + "\n"
    cells = [
        [KIND_WORDS[item.kind], item.name, human_size(item.size), _used_by(item)]
        for item in inventory.items
    ]
    header = ["KIND", "NAME", "SIZE", "USED BY"]
    kind_width, size_width = (max(len(row[i]) for row in [header, *cells]) for i in (0, 2))
    # A name longer than this (a leftover's path) has the row's other cells beneath it, so
    # that one long name does not push every row's USED BY off an 80-column line.
    name_width = max(len(row[1]) for row in [header, *cells] if len(row[1]) <= _LONG_NAME)
    lines = _row(header, kind_width, name_width, size_width, width)
    for row, item in zip(cells, inventory.items, strict=True):
        lines += _row(row, kind_width, name_width, size_width, width)
        if not item.used_by and item.origin:
            lines += beneath(f"from {item.origin}", width)
    prunable = inventory.prunable()
    total = f"{len(inventory.items)} items, {human_size(inventory.bytes_of(inventory.items))}"
    if prunable:
        freed = human_size(inventory.freed_by(prunable))
        total += f"; {len(prunable)} unused ({freed})"
        total += ": see below" if view.refusals() else ": `gateway cache prune` removes them"
    else:
        total += "; nothing unused"
    total_lines = beneath(total, width, indent="")
    return "\n".join([*lines, "", *total_lines, *_notes(view, url, width)]) + "\n"


def _row(cells: list[str], kind: int, name: int, size: int, width: int) -> list[str]:
    """One row: KIND and NAME left-aligned, SIZE right-aligned, USED BY wrapped in what is
    left of the line (beneath the row when too little is)."""
    lines = []
    head = f"{cells[0].ljust(kind)}{GAP}{cells[1].ljust(name)}"
    if len(cells[1]) > name:
        lines.append(head)
        head = " " * len(head[: len(cells[0].ljust(kind)) + len(GAP) + name])
    head += f"{GAP}{cells[2].rjust(size)}{GAP}"
    room = width - len(head)
    if room < _NARROWEST:
        return [*lines, head.rstrip(), *beneath(cells[3], width, indent="    ")]
    used = textwrap.wrap(cells[3], room, break_long_words=False, break_on_hyphens=False)
    used = used or [""]
    return [*lines, (head + used[0]).rstrip(), *(" " * len(head) + more for more in used[1:])]


def _used_by(item: CacheItem) -> str:
    if item.used_by:
        return ", ".join(item.used_by)
    return "- (damaged)" if item.damaged else "-"


def _notes(view: _View, url: str, width: int) -> list[str]:
    notes = []
    for pid in sorted(view.asked):
        notes.append(f"gateway {pid} runs on {view.scopes_of(pid)}: asked at {url}")
        for busy in view.asked[pid].busy:
            notes.append(f"gateway {pid}: {busy}: nothing is removed until it is done")
    for pid, why in sorted(view.unasked.items()):
        notes.append(
            f"gateway {pid} runs on {view.scopes_of(pid)} but could not be asked what it "
            f"serves: {why}. Until it can, what it serves beyond its manifests is not shown, "
            "and nothing is removed."
        )
    notes += view.inventory.problems
    notes += [f"{scope}: {why}" for scope, why in view.untried.items()]
    return [line for note in notes for line in beneath(note, width, indent="")]


def human_size(size: int) -> str:
    """``512 B``, ``4.0 KiB``, ``12.3 MiB``, ``1.2 GiB``: as ``du -h`` says it, in one word."""
    if size < 1024:
        return f"{size} B"
    value = float(size)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} TiB"
