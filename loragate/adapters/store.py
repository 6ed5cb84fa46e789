"""Content-addressed adapter store: each version kept by the sha256 of its converted files.

Layout under ``root``::

    versions/<sha256>/adapter_config.json
    versions/<sha256>/adapter_model.safetensors
    versions/<sha256>/.loragate.json      # per-file digests, size, source, timestamps
    tmp/                                  # work dirs, renamed into versions/ when complete

A version appears in ``versions/`` only by an atomic rename of a complete directory, so a
half-written or interrupted download is never visible. Every load is preceded by ``verify``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

META_FILENAME = ".loragate.json"
# Only these files make up an adapter as vLLM loads it; anything else in a source dir is ignored.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


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


class AdapterStore:
    def __init__(self, root: Path, max_bytes: int | None = None) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.versions = root / "versions"
        self.tmp = root / "tmp"
        self.versions.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.evictions = 0

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
        tmp = index / f".{source_digest}.tmp"
        tmp.write_text(stored.digest)
        os.replace(tmp, index / source_digest)

    def work_dir(self) -> Path:
        """A fresh private directory inside the store's file system, for downloads and conversion."""
        return Path(tempfile.mkdtemp(prefix="work-", dir=self.tmp))

    def put_dir(self, peft_dir: Path, meta: dict[str, Any] | None = None) -> StoredAdapter:
        """Store the PEFT adapter in ``peft_dir`` (idempotent); returns the stored version."""
        missing = [name for name in ADAPTER_FILES if not (peft_dir / name).is_file()]
        if missing:
            raise StoreError(f"{peft_dir} is not a PEFT adapter: missing {', '.join(missing)}")
        digests = {name: file_digest(peft_dir / name) for name in ADAPTER_FILES}
        digest = content_digest(digests)
        existing = self.get(digest)
        if existing is not None:
            with contextlib.suppress(TamperedAdapterError):
                self.verify(existing)
                self.touch(existing)
                return existing
            shutil.rmtree(existing.path, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix="put-", dir=self.tmp))
        try:
            for name in ADAPTER_FILES:
                shutil.copyfile(peft_dir / name, staging / name)
            if {n: file_digest(staging / n) for n in ADAPTER_FILES} != digests:
                raise StoreError(f"{peft_dir} changed while it was being stored; try again")
            size = sum((staging / name).stat().st_size for name in ADAPTER_FILES)
            record = {
                **(meta or {}),
                "files": digests,
                "size": size,
                "created_at": time.time(),
                "last_used": time.time(),
            }
            (staging / META_FILENAME).write_text(json.dumps(record, indent=2, sort_keys=True))
            # The engine re-reads these files whenever its adapter cache reloads the adapter,
            # and other adapters with the same content share them: read-only, so nothing
            # edits a live adapter by accident (verify() catches the rest).
            for name in ADAPTER_FILES:
                (staging / name).chmod(0o444)
            staging.chmod(0o755)
            target = self.versions / digest
            try:
                os.rename(staging, target)
            except OSError:
                if not target.exists():  # another writer won the race with the same content
                    raise
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        stored = self.get(digest)
        assert stored is not None
        return stored

    def get(self, digest: str) -> StoredAdapter | None:
        path = self.versions / digest
        meta_path = path / META_FILENAME
        if len(digest) != 64 or not meta_path.is_file():
            return None
        meta = json.loads(meta_path.read_text())
        return StoredAdapter(digest=digest, path=path, size=int(meta.get("size", 0)), meta=meta)

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
        if content_digest(expected) != stored.digest:
            raise TamperedAdapterError(f"adapter {stored.short}: its metadata was modified")

    def touch(self, stored: StoredAdapter) -> None:
        meta_path = stored.path / META_FILENAME
        meta = dict(stored.meta, last_used=time.time())
        tmp = meta_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta, indent=2, sort_keys=True))
        os.replace(tmp, meta_path)

    def remove(self, digest: str) -> None:
        shutil.rmtree(self.versions / digest, ignore_errors=True)

    def all(self) -> list[StoredAdapter]:
        found = (self.get(p.name) for p in self.versions.iterdir() if p.is_dir())
        return [s for s in found if s is not None]

    def total_bytes(self) -> int:
        return sum(s.size for s in self.all())

    def evict(self, keep: Iterable[str]) -> list[str]:
        """Drop least-recently-used versions not in ``keep`` until the store fits its cap."""
        if self.max_bytes is None:
            return []
        protected = set(keep)
        candidates = sorted(
            (s for s in self.all() if s.digest not in protected),
            key=lambda s: float(s.meta.get("last_used", 0)),
        )
        evicted = []
        total = self.total_bytes()
        for stored in candidates:
            if total <= self.max_bytes:
                break
            self.remove(stored.digest)
            total -= stored.size
            evicted.append(stored.digest)
        self.evictions += len(evicted)
        return evicted
