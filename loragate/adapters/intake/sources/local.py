"""Local sources: a directory (used in place) or a ``.tar`` / ``.tar.gz`` / ``.tgz`` / ``.zip``
archive (unpacked). Their change marker is read from the file system: sizes and mtimes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from loragate.adapters.intake.archives import archive_kind, extract_archive
from loragate.adapters.intake.sources.fetched import (
    FetchedSource,
    FetchLimits,
    SourceError,
    adapter_root,
)
from loragate.adapters.provenance import Provenance

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip")

_MAX_DIR_ENTRIES = 10_000
# What an adapter directory (any supported layout) holds at its top level.
_ADAPTER_MARKERS = ("adapter_config.json", "adapters.safetensors", "model_adapter", "model_full")


def fetch_local(source: str, dest: Path, limits: FetchLimits) -> FetchedSource:
    """A directory as it is, or an archive unpacked into ``dest``."""
    path = _local_path(source)
    if path.is_dir():
        marker = _dir_fingerprint(path)
        return FetchedSource(path.resolve(), "local", Provenance(source, marker, marker))
    if path.is_file():
        if archive_kind(path) is None:
            raise SourceError(
                f"{path} is not a directory or a {', '.join(ARCHIVE_SUFFIXES)} archive"
            )
        extract_archive(path, dest, max_bytes=limits.max_bytes, max_members=limits.max_members)
        marker = _file_fingerprint(path)
        return FetchedSource(adapter_root(dest), "archive", Provenance(source, marker, marker))
    raise SourceError(
        f"adapter source {source!r} is not an existing directory or archive, nor an hf://, "
        "https:// or tinker:// address"
    )


def local_fingerprint(source: str) -> str:
    """A hash of a directory's file names, sizes and mtimes; an archive's size and mtime."""
    path = _local_path(source)
    if path.is_dir():
        return _dir_fingerprint(path)
    if path.is_file():
        return _file_fingerprint(path)
    raise SourceError(f"adapter source {source!r} does not exist")


def _local_path(source: str) -> Path:
    try:
        return Path(source.removeprefix("file://")).expanduser()
    except RuntimeError:  # ~user for a user that does not exist
        raise SourceError(
            f"adapter source {source!r} names the home directory of an unknown user"
        ) from None


def _file_fingerprint(path: Path) -> str:
    stat = path.stat()
    return f"{stat.st_size}-{stat.st_mtime_ns}"


def _dir_fingerprint(path: Path) -> str:
    """A change marker for a local adapter dir: names, sizes and mtimes of what it holds."""
    if not any((path / marker).exists() for marker in _ADAPTER_MARKERS):
        raise SourceError(
            f"{path} does not look like an adapter directory (no adapter_config.json, "
            "adapters.safetensors or Vi run layout in it)"
        )
    digest = hashlib.sha256()
    seen = 0
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            seen += 1
            if seen > _MAX_DIR_ENTRIES:
                raise SourceError(
                    f"{path} holds more than {_MAX_DIR_ENTRIES} files: not an adapter"
                )
            full = Path(root) / name
            try:
                stat = full.lstat()  # a dangling symlink is described, not followed
            except OSError as exc:
                raise SourceError(f"cannot read {full}: {exc.strerror}") from None
            rel = full.relative_to(path).as_posix()
            digest.update(f"{rel}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()
