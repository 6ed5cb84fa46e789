"""Local sources: a directory (used in place) or a ``.tar`` / ``.tar.gz`` / ``.tgz`` / ``.zip``
archive (unpacked). Their change marker is read from the file system: sizes and mtimes.

A local path an admin client sends (not one the operator configured) must lie under the
adapter source roots (``admit_local_path``): the admin key opens adapters, not the gateway
user's files. Whatever lies outside them gets one answer, whether it exists or not.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from loragate.adapters.intake.archives import archive_kind, extract_archive
from loragate.adapters.intake.sources.fetched import FetchedSource, FetchLimits, adapter_root
from loragate.adapters.provenance import Provenance
from loragate.fetching import SourceError

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip")

_MAX_DIR_ENTRIES = 10_000
# What an adapter directory (any supported layout) holds at its top level.
_ADAPTER_MARKERS = ("adapter_config.json", "adapters.safetensors", "model_adapter", "model_full")
_ROOTS_SETTING = "--adapter-source-root (LORAGATE_ADAPTER_SOURCE_ROOTS)"


class SourceNotAllowed(SourceError):
    """A local source an admin client may not name: outside the adapter source roots, or
    holding a link that leads out of them."""


def resolved_under(source: str, roots: Sequence[Path]) -> Path | None:
    """``source``'s real path (links followed, ``..`` collapsed) if it lies under one of
    ``roots``; None otherwise, or when it cannot be resolved (a link loop, ``~nobody``)."""
    real_roots = _real_paths(roots)
    try:
        path = _local_path(source).resolve()
    except (SourceError, OSError, RuntimeError, ValueError):
        return None
    return path if _under(path, real_roots) else None


def admit_local_path(source: str, roots: Sequence[Path]) -> Path:
    """The real path of the local ``source`` an admin client sent, once it is known to lie
    under one of ``roots`` with no link in it leading out of them: what is fetched is then
    what was checked. ``SourceNotAllowed`` otherwise, in words that are the same whether
    the path exists or what it is, and that never show what a link points to."""
    path = resolved_under(source, roots)
    if path is None:
        raise SourceNotAllowed(_outside_the_roots(roots))
    if path.is_dir():
        _refuse_links_out(path, _real_paths(roots))
    return path


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


def _real_paths(roots: Sequence[Path]) -> list[Path]:
    real = []
    for root in roots:
        try:
            real.append(root.expanduser().resolve())
        except (OSError, RuntimeError, ValueError):
            continue  # a root that cannot be resolved admits nothing
    return real


def _under(path: Path, roots: Sequence[Path]) -> bool:
    return any(path.is_relative_to(root) for root in roots)


def _outside_the_roots(roots: Sequence[Path]) -> str:
    if not roots:
        return (
            "this gateway reads no local adapter source sent to its admin API: no adapter "
            "source root is set; send an hf://, https:// or tinker:// source, or have the "
            f"operator name the adapter's directory with {_ROOTS_SETTING}"
        )
    listed = ", ".join(str(root) for root in roots)
    return (
        f"the admin API reads local adapter sources only under the adapter source roots "
        f"({listed}; {_ROOTS_SETTING}); put the adapter there, or send an hf://, https:// "
        "or tinker:// source"
    )


def _refuse_links_out(path: Path, roots: Sequence[Path]) -> None:
    """Every link in the directory ``path`` must lead inside ``roots``: the pipeline reads
    through them (``adapter_config.json``, a Vi run's folders). Linked folders are walked
    too, and the walk is bounded, so a link loop ends it."""
    seen = 0
    for folder, dirs, files in os.walk(path, followlinks=True):
        for name in (*dirs, *files):
            seen += 1
            if seen > _MAX_DIR_ENTRIES:
                raise SourceError(
                    f"the adapter source holds more than {_MAX_DIR_ENTRIES} entries: not an adapter"
                )
            entry = Path(folder) / name
            if not entry.is_symlink():
                continue
            try:
                target = entry.resolve()
            except (OSError, RuntimeError):
                target = None
            if target is None or not _under(target, roots):
                raise SourceNotAllowed(
                    f"the adapter source holds a link that leads out of the adapter source "
                    f"roots ({entry.relative_to(path)}); copy what it points to into the "
                    "adapter's directory instead"
                )


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
