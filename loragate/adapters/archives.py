"""Unpack an adapter archive (tar, tar.gz, zip) without trusting it.

Only regular files and directories are unpacked. Absolute paths, ``..`` components, links
of either kind, devices and FIFOs are refused, and the total unpacked size and the member
count are capped. Everything is unpacked into a private staging directory that is renamed
onto ``dest`` only when the whole archive passed, so a refused archive leaves nothing.
"""

from __future__ import annotations

import shutil
import stat
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

DEFAULT_MAX_BYTES = 2 * 1024**3
DEFAULT_MAX_MEMBERS = 10_000
_CHUNK = 1 << 20


class UnsafeArchiveError(ValueError):
    """The archive is not a plain tree of files within the limits; nothing was unpacked."""


@dataclass(frozen=True)
class _Member:
    name: str
    is_dir: bool
    size: int


def archive_kind(path: Path) -> str | None:
    """``"zip"``, ``"tar"`` (plain or compressed) or None, judged by content, not by name."""
    with path.open("rb") as handle:
        head = handle.read(512)
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "zip"
    if head[:2] == b"\x1f\x8b" or head[:3] == b"BZh" or head[:6] == b"\xfd7zXZ\x00":
        return "tar"
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    return None


def extract_archive(
    archive: Path,
    dest: Path,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_members: int = DEFAULT_MAX_MEMBERS,
) -> Path:
    """Unpack ``archive`` into ``dest`` (absent or empty); returns ``dest``.

    Raises ``UnsafeArchiveError`` (and leaves ``dest`` as it was) when the archive holds
    anything but plain files and directories inside ``dest`` or exceeds the limits.
    """
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UnsafeArchiveError(f"cannot unpack into {dest}: it is not an empty directory")
    kind = archive_kind(archive)
    if kind is None:
        raise UnsafeArchiveError(f"{archive.name} is not a tar, tar.gz or zip archive")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.unpack-", dir=dest.parent))
    try:
        with _open(archive, kind) as reader:
            members = reader.members()
            _check_limits(members, max_bytes, max_members)
            written = 0
            for member in members:
                target = staging.joinpath(*PurePosixPath(member.name).parts)
                if member.is_dir:
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with reader.open(member) as source, target.open("wb") as sink:
                    while block := source.read(_CHUNK):
                        written += len(block)
                        if written > max_bytes:
                            raise UnsafeArchiveError(
                                f"{archive.name} unpacks to more than {max_bytes} bytes; refused"
                            )
                        sink.write(block)
        if dest.exists():
            dest.rmdir()
        staging.rename(dest)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError) as exc:
        raise UnsafeArchiveError(
            f"{archive.name} is a damaged archive ({exc}); download it again"
        ) from exc
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def _check_limits(members: list[_Member], max_bytes: int, max_members: int) -> None:
    if len(members) > max_members:
        raise UnsafeArchiveError(
            f"the archive has {len(members)} members, more than the limit {max_members}"
        )
    total = sum(m.size for m in members)
    if total > max_bytes:
        raise UnsafeArchiveError(
            f"the archive unpacks to {total} bytes, more than the limit {max_bytes}"
        )


def _safe_name(name: str) -> str:
    """The member's relative POSIX path, or ``UnsafeArchiveError`` if it could leave ``dest``."""
    if "\\" in name or "\x00" in name:
        raise UnsafeArchiveError(
            f"archive member {name!r} has a backslash or NUL in its name; refused"
        )
    path = PurePosixPath(name)
    if path.is_absolute() or name.startswith("/"):
        raise UnsafeArchiveError(f"archive member {name!r} has an absolute path; refused")
    parts = [p for p in path.parts if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchiveError(
            f"archive member {name!r} points outside the archive (..); refused"
        )
    if parts and parts[0].endswith(":"):
        raise UnsafeArchiveError(f"archive member {name!r} names a drive; refused")
    return "/".join(parts)


class _Reader:
    def members(self) -> list[_Member]:
        raise NotImplementedError

    def open(self, member: _Member) -> IO[bytes]:
        raise NotImplementedError


class _TarReader(_Reader):
    def __init__(self, tar: tarfile.TarFile) -> None:
        self.tar = tar
        self.by_name: dict[str, tarfile.TarInfo] = {}

    def members(self) -> list[_Member]:
        found = []
        for info in self.tar.getmembers():
            name = _safe_name(info.name)
            if info.issym() or info.islnk():
                raise UnsafeArchiveError(f"archive member {info.name!r} is a link; refused")
            if not (info.isreg() or info.isdir()):
                raise UnsafeArchiveError(
                    f"archive member {info.name!r} is a device, FIFO or other special file; refused"
                )
            if not name:
                continue
            self.by_name[name] = info
            found.append(_Member(name, info.isdir(), 0 if info.isdir() else info.size))
        return found

    def open(self, member: _Member) -> IO[bytes]:
        handle = self.tar.extractfile(self.by_name[member.name])
        if handle is None:
            raise UnsafeArchiveError(f"archive member {member.name!r} has no data")
        return handle


class _ZipReader(_Reader):
    def __init__(self, archive: zipfile.ZipFile) -> None:
        self.zip = archive
        self.by_name: dict[str, zipfile.ZipInfo] = {}

    def members(self) -> list[_Member]:
        found = []
        for info in self.zip.infolist():
            name = _safe_name(info.filename)
            mode = info.external_attr >> 16
            if stat.S_ISLNK(mode):
                raise UnsafeArchiveError(f"archive member {info.filename!r} is a link; refused")
            # Unix type bits are optional in zip files; judge them only when present.
            kind = stat.S_IFMT(mode)
            if kind and kind not in (stat.S_IFREG, stat.S_IFDIR):
                raise UnsafeArchiveError(
                    f"archive member {info.filename!r} is a device, FIFO or other special file; refused"
                )
            if info.flag_bits & 0x1:
                raise UnsafeArchiveError(f"archive member {info.filename!r} is encrypted; refused")
            if not name:
                continue
            self.by_name[name] = info
            found.append(_Member(name, info.is_dir(), 0 if info.is_dir() else info.file_size))
        return found

    def open(self, member: _Member) -> IO[bytes]:
        return self.zip.open(self.by_name[member.name])


@contextmanager
def _open(archive: Path, kind: str) -> Iterator[_Reader]:
    if kind == "zip":
        with zipfile.ZipFile(archive) as handle:
            yield _ZipReader(handle)
    else:
        with tarfile.open(archive, "r:*") as handle:
            yield _TarReader(handle)
