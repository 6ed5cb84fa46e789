"""What a cache dir holds, how much of the disk each item takes, what uses it, and how an item
nothing uses is taken out.

Each scope of a cache dir (the dir itself, and each catalog model's ``models/ID``, the cache
dir that model's gateway part locks and writes) may hold:

- ``adapters/versions/<sha256>/``: the adapter store's versions (``adapters.store``);
- ``models/gguf/<sha256>-<dtype>/``: a GGUF file dequantized for serving (``base_model.gguf``);
- ``models/models--ORG--NAME/`` and ``adapters/hf/``: Hugging Face downloads from before
  they went to the user's Hugging Face cache (``base_model.hub_cache``);
- ``logs/``: the engine's log;
- leftovers: the work dirs of an add, a conversion, a build or a removal that did not finish.

The cache dir itself also holds the built demos (``demo``, ``demo-smollm2``, ...). Beside it,
the Hugging Face cache holds the base models ``gateway pull`` downloaded: listed, but shared
with every other program that reads it, so never pruned (``gateway cache remove`` takes one by
name).

An item is in use when an adapter manifest names it (a version as an adapter's live or
rollback version; a base model as the base of its adapters, whose manifest is keyed by the
model's directory), when a running gateway says it serves it, or when a running process's
command line names it. What nothing uses is ``prunable``, but for the logs and the Hugging
Face cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import stat
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loragate.adapters.manifest import manifest_key
from loragate.adapters.store import AdapterStore
from loragate.base_model.gguf import GGUF_DIRNAME, INFO_FILENAME
from loragate.base_model.hub_cache import MODELS_DIRNAME
from loragate.cache.holders import processes_naming
from loragate.demo.layout import BASE_DIRNAME, RECIPE_FILENAME
from loragate.logs import redact_urls
from loragate.model_names import is_gguf_source

ADAPTER_VERSION = "adapter_version"
BASE_MODEL = "base_model"
ADAPTER_SOURCE = "adapter_source"
HF_DOWNLOAD = "hf_download"
GGUF_CONVERSION = "gguf_conversion"
DEMO = "demo"
LOGS = "logs"
LEFTOVER = "leftover"
# Each kind in words, in the order a listing shows them: models first, leftovers last.
KIND_WORDS = {
    BASE_MODEL: "base model",
    HF_DOWNLOAD: "hf download",
    GGUF_CONVERSION: "GGUF conversion",
    DEMO: "demo",
    ADAPTER_SOURCE: "adapter source",
    ADAPTER_VERSION: "adapter version",
    LOGS: "logs",
    LEFTOVER: "leftover",
}
# Where a removal renames an item first: it is whole, or gone, or a leftover of this name.
REMOVING_PREFIX = ".removing-"
_REPO_PREFIX = "models--"
_DIGEST = re.compile(r"[0-9a-f]{64}")
_Inode = tuple[int, int]


class CacheBusy(RuntimeError):
    """The item's writer (a conversion, a demo build) is at work on it now."""


@dataclass
class CacheItem:
    kind: str
    name: str
    path: Path
    scope: Path | None  # the cache dir of the gateway that writes it; None: the Hugging Face cache
    size: int = 0
    used_by: list[str] = field(default_factory=list)
    origin: str | None = None  # where it came from: an adapter's source, a GGUF file
    damaged: bool = False
    lock: Path | None = None  # the flock its writer holds while it writes it
    trash: Path | None = None  # the dir a removal renames it into first (same file system)
    links: Counter[_Inode] = field(default_factory=Counter, repr=False)
    model_dirs: list[Path] = field(default_factory=list, repr=False)  # what a manifest keys

    @property
    def shared(self) -> bool:
        return self.scope is None

    @property
    def prunable(self) -> bool:
        return not self.used_by and not self.shared and self.kind != LOGS

    def use(self, why: str) -> None:
        if why not in self.used_by:
            self.used_by.append(why)

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "path": str(self.path),
            "size_bytes": self.size,
            "used_by": self.used_by,
            "origin": self.origin,
            "damaged": self.damaged,
            "shared": self.shared,
            "prunable": self.prunable,
        }


@dataclass
class GatewayServes:
    """What a running gateway said it serves (its admin API), for the scopes its lock is on."""

    pid: int
    versions: dict[str, list[str]]  # digest -> "NAME (live)", "NAME (rollback)"
    models: dict[str, str | None]  # model id -> its --model (None: the demo, or a Vi run)
    busy: list[str] = field(default_factory=list)  # why nothing may be removed just now


@dataclass
class Inventory:
    cache_dir: Path
    items: list[CacheItem]
    manifests: list[Path]
    # What stops a removal: a manifest that cannot be read, a store whose manifest is not found.
    problems: list[str]
    inodes: dict[_Inode, tuple[int, int]]  # (bytes, hard links) of every file seen

    def bytes_of(self, items: Iterable[CacheItem]) -> int:
        """What ``items`` take on disk: a file hard-linked into several counts once."""
        seen = {inode for item in items for inode in item.links}
        return sum(self.inodes[inode][0] for inode in seen)

    def freed_by(self, items: Iterable[CacheItem]) -> int:
        """What removing ``items`` frees: their files no item left behind links to."""
        counts: Counter[_Inode] = Counter()
        for item in items:
            counts.update(item.links)
        return sum(
            size for inode, (size, links) in self.inodes.items() if counts[inode] >= links > 0
        )

    def prunable(self) -> list[CacheItem]:
        return [item for item in self.items if item.prunable]


def gateway_scopes(cache_dir: Path) -> list[Path]:
    """The cache dir, and each catalog model's own cache dir in it (``models/ID``)."""
    scopes = [cache_dir]
    models = cache_dir / MODELS_DIRNAME
    for child in _dirs(models):
        if child.name == GGUF_DIRNAME or child.name.startswith((_REPO_PREFIX, ".")):
            continue
        if any((child / name).exists() for name in ("gateway.lock", "adapters", "logs")):
            scopes.append(child)
    return scopes


def take_inventory(
    cache_dir: Path,
    state_dir: Path,
    hub_cache: Path | None,
    gateways: Iterable[GatewayServes] = (),
    running: dict[Path, int] | None = None,
) -> Inventory:
    """Every item of ``cache_dir`` (and of ``hub_cache``), sized, with what uses it: the
    manifests under ``state_dir`` and the cache dir, what ``gateways`` serve, the gateways
    ``running`` on a scope (scope -> pid) and the processes that name an item."""
    running = running or {}
    scan = _Scan(cache_dir)
    scopes = gateway_scopes(cache_dir)
    for scope in scopes:
        scan.scope(scope)
    scan.top()
    if hub_cache is not None and not any(
        hub_cache.resolve() in (s, s / MODELS_DIRNAME, s / "adapters" / "hf") for s in scopes
    ):
        scan.repos(hub_cache, None)
    order = list(KIND_WORDS)
    scan.items.sort(key=lambda item: (order.index(item.kind), item.shared, item.name))
    inventory = Inventory(cache_dir, scan.items, [], [], scan.inodes)
    _mark_manifests(inventory, state_dir, running)
    for gateway in gateways:
        _mark_served(inventory, gateway, [s for s, pid in running.items() if pid == gateway.pid])
    for item in inventory.items:
        pid = running.get(item.scope) if item.scope is not None else None
        if pid is not None and item.kind in (LOGS, LEFTOVER):
            item.use(f"gateway {pid}")  # its log, its work in progress
        if item.lock is not None and _locked(item.lock):
            item.use("being written now")
    idle = {item.path: item for item in inventory.items if not item.used_by}
    for path, users in processes_naming(idle).items():
        for user in users:
            idle[path].use(user)
    return inventory


# ----- scanning ---------------------------------------------------------------------------


class _Scan:
    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir
        self.items: list[CacheItem] = []
        self.inodes: dict[_Inode, tuple[int, int]] = {}

    def add(self, kind: str, name: str, path: Path, scope: Path | None, **more: Any) -> CacheItem:
        item = CacheItem(kind, name, path, scope, **more)
        for inode, size, links in _files(path):
            item.links[inode] += 1
            self.inodes[inode] = (size, links)
        item.size = sum(self.inodes[inode][0] for inode in item.links)
        self.items.append(item)
        return item

    def relative(self, path: Path) -> str:
        return path.relative_to(self.cache_dir).as_posix()

    def scope(self, scope: Path) -> None:
        prefix = "" if scope == self.cache_dir else f"{scope.name}/"
        store_root = scope / "adapters"
        if (store_root / "versions").is_dir():
            store = AdapterStore(store_root)
            for stored in store.all():
                source = stored.meta.get("source")
                self.add(
                    ADAPTER_VERSION,
                    prefix + stored.short,
                    stored.path,
                    scope,
                    origin=redact_urls(source) if isinstance(source, str) else None,
                    trash=store.tmp,
                )
            for digest in store.damaged():
                self.add(
                    ADAPTER_VERSION,
                    prefix + digest[:12],
                    store.versions / digest,
                    scope,
                    damaged=True,
                    trash=store.tmp,
                )
        for work in sorted(_entries(store_root / "tmp")):  # an add's, or a removal's
            self.add(LEFTOVER, self.relative(work), work, scope)
        self.repos(store_root / "hf", scope)
        models = scope / MODELS_DIRNAME
        self.repos(models, scope)
        self.conversions(models / GGUF_DIRNAME, scope)
        if (scope / "logs").is_dir():
            self.add(LOGS, self.relative(scope / "logs"), scope / "logs", scope, trash=scope)
        for parent in (scope, models, store_root / "hf"):
            self.removals_cut_short(parent, scope)

    def top(self) -> None:
        """The demos the cache dir holds, and their builds that did not finish."""
        root = self.cache_dir
        for child in _dirs(root):
            if (child / RECIPE_FILENAME).is_file() and not child.name.startswith("."):
                self.add(
                    DEMO,
                    child.name,
                    child,
                    root,
                    lock=root / f".{child.name}.lock",
                    trash=root,
                    model_dirs=[child / BASE_DIRNAME],
                )
            elif child.name.startswith(".") and "-build-" in child.name:
                built = child.name[1:].partition("-build-")[0]
                self.add(LEFTOVER, child.name, child, root, lock=root / f".{built}.lock")

    def conversions(self, root: Path, scope: Path) -> None:
        for child in _dirs(root):
            if child.name.startswith(REMOVING_PREFIX):
                self.add(LEFTOVER, self.relative(child), child, scope)
            elif child.name.startswith("."):  # a conversion under way, or cut short
                digest, _, rest = child.name[1:].partition("-")
                dtype = rest.rpartition("-")[0]
                locks = sorted(root.glob(f".{digest}*-{dtype}.lock"))
                self.add(
                    LEFTOVER, self.relative(child), child, scope, lock=locks[0] if locks else None
                )
            else:
                info = _json_object(child / INFO_FILENAME)
                source = info.get("source")
                self.add(
                    GGUF_CONVERSION,
                    _conversion_name(child.name),
                    child,
                    scope,
                    origin=redact_urls(source) if isinstance(source, str) else None,
                    lock=root / f".{child.name}.lock",
                    trash=root,
                    model_dirs=[child],
                )

    def repos(self, root: Path, scope: Path | None) -> None:
        """Hugging Face model repos (``models--ORG--NAME``) under ``root``."""
        for child in _dirs(root):
            if not child.name.startswith(_REPO_PREFIX):
                continue
            snapshots = _dirs(child / "snapshots")
            names = {p.name for snapshot in snapshots for p in snapshot.rglob("*")}
            if "adapter_config.json" in names:
                kind = ADAPTER_SOURCE
            elif "config.json" in names:
                kind = BASE_MODEL
            else:
                kind = HF_DOWNLOAD
            repo = child.name[len(_REPO_PREFIX) :].replace("--", "/")
            self.add(
                kind,
                repo,
                child,
                scope,
                trash=root if scope is not None else None,
                model_dirs=snapshots,
            )

    def removals_cut_short(self, parent: Path, scope: Path) -> None:
        for child in _dirs(parent):
            if child.name.startswith(REMOVING_PREFIX):
                self.add(LEFTOVER, self.relative(child), child, scope)


def _conversion_name(dirname: str) -> str:
    """``<sha256>-<dtype>`` shortened as a version is: ``<sha12>-<dtype>``."""
    digest, _, dtype = dirname.partition("-")
    return f"{digest[:12]}-{dtype}" if len(digest) == 64 else dirname


def _dirs(path: Path) -> list[Path]:
    return sorted(p for p in _entries(path) if p.is_dir() and not p.is_symlink())


def _entries(path: Path) -> Iterator[Path]:
    with contextlib.suppress(OSError):
        yield from path.iterdir()


def _files(root: Path) -> Iterator[tuple[_Inode, int, int]]:
    """Each regular file under ``root`` (links not followed): its inode, bytes and links."""
    for parent, _, names in os.walk(root):
        for name in names:
            with contextlib.suppress(OSError):
                info = os.lstat(os.path.join(parent, name))
                if stat.S_ISREG(info.st_mode):
                    yield (info.st_dev, info.st_ino), info.st_size, info.st_nlink


def _json_object(path: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError, RecursionError):
        loaded = json.loads(path.read_bytes())
        if isinstance(loaded, dict):
            return loaded
    return {}


# ----- what uses each item ----------------------------------------------------------------


def _mark_manifests(inventory: Inventory, state_dir: Path, running: dict[Path, int]) -> None:
    """Mark what each scope's manifests name; a scope whose store holds versions but whose
    manifest is nowhere to be found (another state dir?) is a problem while no gateway runs."""
    cache_dir = inventory.cache_dir
    by_digest: dict[str, list[CacheItem]] = {}
    by_key: dict[str, list[CacheItem]] = {}
    for item in inventory.items:
        if item.kind == ADAPTER_VERSION:
            by_digest.setdefault(item.path.name, []).append(item)
        for model_dir in item.model_dirs:
            for form in {model_dir, model_dir.resolve(), model_dir.absolute()}:
                by_key.setdefault(manifest_key(form), []).append(item)
    for scope in gateway_scopes(cache_dir):
        relative = scope.relative_to(cache_dir)
        prefix = "" if scope == cache_dir else f"{scope.name}/"
        dirs = list(
            dict.fromkeys(
                [state_dir / relative / "adapters" / "manifests", scope / "adapters" / "manifests"]
            )
        )
        found = sorted(p for d in dirs for p in _entries(d) if p.suffix == ".json")
        for path in found:
            try:
                entries = read_manifest(path)
            except ValueError as exc:
                inventory.problems.append(
                    f"the adapter manifest {path} cannot be read ({exc}): repair it, or move it "
                    "away (a gateway starting sets it aside and starts without its adapters)"
                )
                continue
            inventory.manifests.append(path)
            for name, digest, role in entries:
                for item in by_digest.get(digest, []):
                    item.use(f"{prefix}{name} ({role})")
            names = sorted({prefix + name for name, _, _ in entries})
            for item in by_key.get(path.stem, []) if names else []:
                item.use(f"base of {_some(names)}")
        has_versions = any(i.kind == ADAPTER_VERSION and i.scope == scope for i in inventory.items)
        if has_versions and not found and scope not in running:
            inventory.problems.append(
                f"{scope / 'adapters'} holds adapter versions but no adapter manifest was found "
                f"in {' or '.join(map(str, dirs))}: if its gateway keeps its state elsewhere "
                "(--state-dir, LORAGATE_STATE_DIR, systemd's StateDirectory=), pass the same "
                "--state-dir"
            )


def read_manifest(path: Path) -> list[tuple[str, str, str]]:
    """(adapter name, version, ``live`` or ``rollback``) of every version an adapter manifest
    names, entries that would not load included; ``ValueError`` when it cannot be read. Read
    only: unlike ``Manifest.load``, a damaged one is left where it is."""
    try:
        raw = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise ValueError(str(exc) or type(exc).__name__) from None
    records = raw.get("adapters") if isinstance(raw, dict) else None
    if not isinstance(records, dict):
        raise ValueError("it has no 'adapters' object")
    named = []
    for name, record in records.items():
        for key, role in (("active", "live"), ("previous", "rollback")):
            value = record.get(key) if isinstance(record, dict) else None
            if isinstance(value, str) and _DIGEST.fullmatch(value):
                named.append((str(name), value, role))
    return named


def _mark_served(inventory: Inventory, gateway: GatewayServes, scopes: list[Path]) -> None:
    for item in inventory.items:
        if item.kind == ADAPTER_VERSION:
            for label in gateway.versions.get(item.path.name, []):
                item.use(label)
    for model_id, spec in gateway.models.items():
        for item in inventory.items:
            note = _serves(item, spec, scopes)
            if note is not None:
                item.use(f"gateway {gateway.pid} ({model_id}){note}")


def _serves(item: CacheItem, spec: str | None, scopes: list[Path]) -> str | None:
    """Whether a gateway serving ``--model spec`` uses ``item``: "" if so, a note when it may,
    None when it does not."""
    if item.kind not in (BASE_MODEL, HF_DOWNLOAD, GGUF_CONVERSION, DEMO):
        return None
    if spec is None:  # the demo, or a Vi run's model: which one is not said
        if item.kind == DEMO:
            return ""
        return " (may use it)" if item.scope in scopes else None
    if is_gguf_source(spec):
        if item.kind == GGUF_CONVERSION:
            return "" if item.origin == spec else None
        if spec.startswith("hf://"):
            repo = "/".join(spec[len("hf://") :].split("/")[:2]).partition("@")[0]
            return "" if item.name == repo else None
    elif item.kind in (BASE_MODEL, HF_DOWNLOAD) and item.name == spec:
        return ""
    with contextlib.suppress(OSError, RuntimeError):
        served = Path(spec).expanduser().resolve()
        if served == item.path.resolve() or served.is_relative_to(item.path.resolve()):
            return ""
    return None


def _some(names: list[str], shown: int = 3) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


# ----- taking an item out -----------------------------------------------------------------


def remove_item(item: CacheItem) -> None:
    """Take ``item`` out of the cache: renamed aside first, so that a reader finds it whole
    or not at all (a removal cut short leaves a leftover, never half an item), then deleted;
    under the flock its writer takes (a conversion, a demo build): ``CacheBusy`` while that
    one is at work."""
    with _writer_lock(item.lock):
        _discard(item.path, item.trash)


def _discard(path: Path, trash: Path | None) -> None:
    if trash is not None:
        aside = Path(tempfile.mkdtemp(prefix=REMOVING_PREFIX, dir=trash))
        try:
            os.rename(path, aside / path.name)
        finally:
            shutil.rmtree(aside)
    elif path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def _writer_lock(path: Path | None) -> Iterator[None]:
    if path is None or not path.exists():
        yield
        return
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CacheBusy(f"{path.name[1:].removesuffix('.lock')} is being written now") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _locked(path: Path) -> bool:
    try:
        with _writer_lock(path):
            return False
    except CacheBusy:
        return True
    except OSError:  # not ours to open: taken as not being written
        return False
