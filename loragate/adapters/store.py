"""Content-addressed adapter store: each version kept by the sha256 of its converted files.

Layout under ``root``::

    versions/<sha256>/adapter_config.json
    versions/<sha256>/adapter_model.safetensors
    versions/<sha256>/.loragate.json      # per-file digests, size, source, preset, timestamps
    tmp/                                  # work dirs, renamed into versions/ when complete

A version is its weights and its preset (``preset``): the id hashes the file digests and, when
there is a preset, the preset's digest, so the same weights with another preset are another
version. Such versions share the weights' files (hard links, read-only): a new preset costs
no copy of the weights where the file system allows it.

A version appears in ``versions/`` only by an atomic rename of a complete directory, so a
half-written or interrupted download is never visible. Every load is preceded by ``verify``.
Metadata is rewritten atomically (temp file, fsync, rename). A version whose metadata is
empty or garbled anyway (a crash of an older version, a disk fault, a hand edit) is damaged:
``get`` logs it and answers None, as for a missing version, so the caller repairs it from its
source (storing the same content replaces it) and eviction drops it when nothing needs it.
Metadata is checked by type when read: the file digests and size must hold (else the version
is damaged, as above); a bad ``last_used`` or provenance only costs that value (eviction
takes the version as never used, rollback as stored without a provenance).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loragate.adapters.preset import Preset, PresetError, preset_of_record
from loragate.adapters.provenance import Provenance

log = logging.getLogger("loragate.adapters")

META_FILENAME = ".loragate.json"
# Only these files make up an adapter as vLLM loads it; anything else in a source dir is ignored.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# The name a preset's digest joins the file digests under, in a version's id.
PRESET_KEY = "preset"


class StoreError(Exception):
    pass


class TamperedAdapterError(StoreError):
    pass


@dataclass(frozen=True)
class StoredAdapter:
    digest: str
    path: Path
    size: int
    meta: dict[str, Any]

    @property
    def short(self) -> str:
        return self.digest[:12]

    @property
    def provenance(self) -> Provenance | None:
        """Where this version was first stored from; None if it was stored without one (or
        its keys do not hold strings)."""
        meta = self.meta
        if not isinstance(meta.get("source"), str) or not all(
            isinstance(meta.get(key), str | None) for key in ("revision", "fingerprint")
        ):
            return None
        return Provenance.from_record(meta)

    @property
    def weights(self) -> str:
        """The digest of the weights alone (the version's own when it has no preset)."""
        value = self.meta.get("weights")
        return value if isinstance(value, str) else self.digest

    @property
    def preset(self) -> Preset | None:
        """The preset stored with this version; None for none. ``PresetError`` when its
        record does not hold one (``verify`` reports that as tampering)."""
        return preset_of_record(self.meta.get(PRESET_KEY))

    @property
    def last_used(self) -> float:
        """When this version was last used (for eviction); 0, never, when not a time."""
        value = self.meta.get("last_used")
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        return 0.0


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tree_digest(root: Path) -> str:
    """A digest of every file under ``root`` (relative names and contents)."""
    files = {
        path.relative_to(root).as_posix(): file_digest(path)
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }
    return content_digest(files)


def content_digest(file_digests: dict[str, str]) -> str:
    """The version id: a hash over the (name, file digest) pairs, in name order."""
    digest = hashlib.sha256()
    for name in sorted(file_digests):
        digest.update(name.encode() + b"\0" + file_digests[name].encode() + b"\n")
    return digest.hexdigest()


def version_digest(file_digests: dict[str, str], preset: Preset | None) -> str:
    """A version's id: its files' ``content_digest``, the preset's digest among them if any
    (an empty preset is none: the weights' own id)."""
    if not preset:
        return content_digest(file_digests)
    return content_digest({**file_digests, PRESET_KEY: preset.digest})


class AdapterStore:
    def __init__(self, root: Path, max_bytes: int | None = None) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.versions = root / "versions"
        self.tmp = root / "tmp"
        self.versions.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.evictions = 0
        self._reported: set[str] = set()  # damaged versions already logged

    def converted_from(self, source_digest: str) -> StoredAdapter | None:
        """The version earlier converted from source files with this digest, if still stored."""
        try:
            digest = (self.root / "sources" / source_digest).read_text().strip()
        except OSError:
            return None
        stored = self.get(digest)
        if stored is None:
            return None
        try:
            self.verify(stored)
        except TamperedAdapterError:
            return None
        return stored

    def remember_conversion(self, source_digest: str, stored: StoredAdapter) -> None:
        index = self.root / "sources"
        index.mkdir(exist_ok=True)
        write_atomic(index / source_digest, stored.digest)

    def work_dir(self) -> Path:
        """A fresh private directory inside the store's file system, for downloads and conversion."""
        return Path(tempfile.mkdtemp(prefix="work-", dir=self.tmp))

    def put_dir(
        self, peft_dir: Path, meta: dict[str, Any] | None = None, preset: Preset | None = None
    ) -> StoredAdapter:
        """Store the PEFT adapter in ``peft_dir`` with ``preset`` (idempotent); returns the
        stored version."""
        missing = [name for name in ADAPTER_FILES if not (peft_dir / name).is_file()]
        if missing:
            raise StoreError(f"{peft_dir} is not a PEFT adapter: missing {', '.join(missing)}")
        digests = {name: file_digest(peft_dir / name) for name in ADAPTER_FILES}
        digest = version_digest(digests, preset)
        weights = content_digest(digests)
        existing = self.get(digest)
        if existing is not None:
            with contextlib.suppress(TamperedAdapterError):
                self.verify(existing)
                self.touch(existing)
                return existing
        # Absent, or damaged (files or metadata): a good copy is staged and takes its place.
        staging = Path(tempfile.mkdtemp(prefix="put-", dir=self.tmp))
        try:
            self._stage_files(peft_dir, staging, digests, weights)
            size = sum((staging / name).stat().st_size for name in ADAPTER_FILES)
            record = {
                **(meta or {}),
                "files": digests,
                "weights": weights,
                PRESET_KEY: preset.to_dict() if preset else None,
                "size": size,
                "created_at": time.time(),
                "last_used": time.time(),
            }
            # Owner-only: the source may carry credentials (rollback fetches from it again).
            write_atomic(
                staging / META_FILENAME, json.dumps(record, indent=2, sort_keys=True), 0o600
            )
            # The engine re-reads these files whenever its adapter cache reloads the adapter,
            # and other adapters with the same content share them: read-only, so nothing
            # edits a live adapter by accident (verify() catches the rest).
            for name in ADAPTER_FILES:
                (staging / name).chmod(0o444)
                _fsync_file(staging / name)
            staging.chmod(0o755)
            target = self.versions / digest
            if target.exists() and not self._intact(digest):
                self._set_aside(target)  # as late as can be: the engine may read it meanwhile
            try:
                os.rename(staging, target)
            except OSError:
                if not target.exists():  # another writer won the race with the same content
                    raise
            _fsync_dir(self.versions)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        stored = self.get(digest)
        assert stored is not None
        return stored

    def _stage_files(
        self, peft_dir: Path, staging: Path, digests: dict[str, str], weights: str
    ) -> None:
        """The adapter's files into ``staging``: hard links to a stored version with the same
        weights (another preset's) when there is one whose files still hold, else copies."""
        sibling = self._with_weights(weights)
        if sibling is not None:
            try:
                for name in ADAPTER_FILES:
                    os.link(sibling / name, staging / name)
                if {n: file_digest(staging / n) for n in ADAPTER_FILES} == digests:
                    return
            except OSError:  # another file system, no hard links: copied below
                pass
            for name in ADAPTER_FILES:
                with contextlib.suppress(FileNotFoundError):
                    (staging / name).unlink()
        for name in ADAPTER_FILES:
            shutil.copyfile(peft_dir / name, staging / name)
        if {n: file_digest(staging / n) for n in ADAPTER_FILES} != digests:
            raise StoreError(f"{peft_dir} changed while it was being stored; try again")

    def _with_weights(self, weights: str) -> Path | None:
        """A stored version's directory holding these weights, if any."""
        if (self.versions / weights).is_dir():
            return self.versions / weights
        for stored in self.all():
            if stored.weights == weights:
                return stored.path
        return None

    def get(self, digest: str) -> StoredAdapter | None:
        """The stored version ``digest``; None when absent or damaged (logged once)."""
        path = self.versions / digest
        meta_path = path / META_FILENAME
        if len(digest) != 64 or not path.is_dir():
            return None
        meta, problem = _read_meta(meta_path)
        if meta is None:
            if digest not in self._reported:
                self._reported.add(digest)
                log.error(
                    "adapter store: version %s is damaged (%s); it will be stored again from "
                    "its source when needed, or dropped",
                    digest[:12],
                    problem,
                )
            return None
        self._reported.discard(digest)
        return StoredAdapter(digest=digest, path=path, size=int(meta["size"]), meta=meta)

    def _intact(self, digest: str) -> bool:
        stored = self.get(digest)
        if stored is None:
            return False
        try:
            self.verify(stored)
        except TamperedAdapterError:
            return False
        return True

    def _set_aside(self, path: Path) -> None:
        aside = Path(tempfile.mkdtemp(prefix="damaged-", dir=self.tmp))
        os.rename(path, aside / path.name)
        shutil.rmtree(aside, ignore_errors=True)

    def verify(self, stored: StoredAdapter) -> None:
        """Raise ``TamperedAdapterError`` unless every file still has its recorded digest."""
        expected: dict[str, str] = stored.meta.get("files", {})
        for name, want in expected.items():
            path = stored.path / name
            if not path.is_file():
                raise TamperedAdapterError(
                    f"adapter {stored.short}: {name} is missing from the store"
                )
            if file_digest(path) != want:
                raise TamperedAdapterError(
                    f"adapter {stored.short}: {name} does not match its recorded sha256 "
                    "(modified on disk); it will not be loaded"
                )
        if version_digest(expected, self.check_preset(stored)) != stored.digest:
            raise TamperedAdapterError(f"adapter {stored.short}: its metadata was modified")

    def check_preset(self, stored: StoredAdapter) -> Preset | None:
        """``stored``'s preset; ``TamperedAdapterError`` when its record does not hold one."""
        try:
            return stored.preset
        except PresetError as exc:
            raise TamperedAdapterError(
                f"adapter {stored.short}: its preset was modified ({exc})"
            ) from None

    def touch(self, stored: StoredAdapter) -> None:
        """Record that ``stored`` was just used (for eviction); never fails the caller."""
        meta = dict(stored.meta, last_used=time.time())
        try:
            write_atomic(
                stored.path / META_FILENAME, json.dumps(meta, indent=2, sort_keys=True), 0o600
            )
        except OSError as exc:  # evicted or removed meanwhile: nothing left to mark
            log.warning("adapter store: cannot mark %s as used: %s", stored.short, exc)

    def remove(self, digest: str) -> None:
        shutil.rmtree(self.versions / digest, ignore_errors=True)

    def all(self) -> list[StoredAdapter]:
        """Every intact version (damaged ones are logged and left out)."""
        found = (self.get(p.name) for p in self.versions.iterdir() if p.is_dir())
        return [s for s in found if s is not None]

    def damaged(self) -> list[str]:
        """The digests of versions whose metadata cannot be read."""
        return [
            p.name
            for p in self.versions.iterdir()
            if p.is_dir() and len(p.name) == 64 and self.get(p.name) is None
        ]

    def total_bytes(self) -> int:
        return _held_bytes(self.all())

    def evict(self, keep: Iterable[str]) -> list[str]:
        """Drop damaged versions not in ``keep``, then least-recently-used ones not in ``keep``
        until the store fits its cap."""
        protected = set(keep)
        for digest in self.damaged():
            if digest not in protected:
                log.warning("adapter store: dropping damaged version %s", digest[:12])
                self.remove(digest)
                self._reported.discard(digest)
        if self.max_bytes is None:
            return []
        candidates = sorted(
            (s for s in self.all() if s.digest not in protected),
            key=lambda s: s.last_used,
        )
        evicted = []
        left = {s.digest: s for s in self.all()}
        for stored in candidates:
            if _held_bytes(left.values()) <= self.max_bytes:
                break
            self.remove(stored.digest)
            del left[stored.digest]
            evicted.append(stored.digest)
        self.evictions += len(evicted)
        return evicted


def _held_bytes(versions: Iterable[StoredAdapter]) -> int:
    """The bytes ``versions`` hold on disk: weights shared by several presets count once."""
    return sum({s.weights: s.size for s in versions}.values())


def _read_meta(path: Path) -> tuple[dict[str, Any] | None, str]:
    """A version's metadata, or None and what is wrong with it."""
    try:
        meta = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None, f"no {META_FILENAME}"
    except OSError as exc:
        return None, f"{META_FILENAME} cannot be read: {exc.strerror}"
    except ValueError as exc:  # empty, garbled, not UTF-8
        return None, f"{META_FILENAME} is not valid JSON: {exc}"
    except RecursionError:
        return None, f"{META_FILENAME} is nested too deeply"
    files, size = (meta.get("files"), meta.get("size")) if isinstance(meta, dict) else (None, None)
    if (
        not isinstance(files, dict)
        or not all(isinstance(name, str) and isinstance(d, str) for name, d in files.items())
        or not isinstance(size, int)
        or isinstance(size, bool)
        or size < 0
    ):
        return None, f"{META_FILENAME} lacks its file digests or size"
    return meta, ""


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Replace ``path`` with ``text`` so that a crash leaves the old or the new file, whole."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a directory be synced
        _fsync_file(path)
