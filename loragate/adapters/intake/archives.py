"""Unpack an adapter archive (tar, tar.gz, zip) without trusting it.

Only regular files and directories are unpacked. Absolute paths, ``..`` components, links
of either kind, devices, FIFOs and sparse files are refused, and the total unpacked size and
the member count are capped. Everything is unpacked into a private staging directory that is
renamed onto ``dest`` only when the whole archive passed, so a refused archive leaves nothing.

The limits hold while the archive is read, not after: tar members are read one at a time and
the count stops at the cap, a tar's long-name and PAX headers are refused past
``MAX_HEADER_BYTES`` before they are read, and a zip's central directory is sized from its
end record before ``zipfile`` parses it. A small ``.tar.gz`` of millions of empty entries or
one huge header fails fast in little memory.
"""

from __future__ import annotations

import shutil
import stat
import struct
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
# A long name or PAX record set this large is no adapter's: refused before it is read.
MAX_HEADER_BYTES = 64 * 1024
# Extension headers (long name, long link, PAX) in a row before a member: a few at most.
MAX_HEADER_CHAIN = 8
# Central directory bytes allowed per member (46 fixed + name + extra + comment).
_ZIP_DIRECTORY_BYTES_PER_MEMBER = 1024
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
        if kind == "zip":
            _check_zip_directory(archive, max_members)
        with _open(archive, kind) as reader:
            count = declared = written = 0
            for member in reader.members():
                count += 1
                if count > max_members:
                    raise UnsafeArchiveError(
                        f"the archive has too many members, more than the limit {max_members}"
                    )
                declared += member.size
                if declared > max_bytes:
                    raise UnsafeArchiveError(
                        f"the archive unpacks to more than the limit {max_bytes} bytes"
                    )
                target = staging.joinpath(*PurePosixPath(member.name).parts)
                _refuse_clash(staging, target, member)
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


def _refuse_clash(staging: Path, target: Path, member: _Member) -> None:
    """Refuse a member whose path needs a file where a directory was unpacked, or the other way
    round (``a`` and ``a/b``): the file system would raise ``FileExistsError`` or
    ``IsADirectoryError``, which says nothing about the archive. A file given twice is allowed
    (the later copy wins, as with ``tar -x``)."""
    for parent in target.relative_to(staging).parents:
        if parent != Path(".") and (staging / parent).is_file():
            raise UnsafeArchiveError(
                f"archive member {member.name!r} is inside {parent.as_posix()!r}, which the "
                "archive also holds as a file; refused"
            )
    if target.is_dir() != member.is_dir and target.exists():
        held = "a directory" if target.is_dir() else "a file"
        raise UnsafeArchiveError(
            f"archive member {member.name!r} is also in the archive as {held}; refused"
        )


def _check_zip_directory(archive: Path, max_members: int) -> None:
    """Refuse a zip whose central directory (which ``zipfile`` reads whole) is over the limits."""
    found = _zip_directory_size(archive)
    if found is None:
        return  # no end record: zipfile says what is wrong
    entries, size = found
    if entries > max_members:
        raise UnsafeArchiveError(
            f"the archive has {entries} members, more than the limit {max_members}"
        )
    if size > max_members * _ZIP_DIRECTORY_BYTES_PER_MEMBER:
        raise UnsafeArchiveError(
            f"the archive's directory is {size} bytes, more than {max_members} adapter files "
            "need; refused"
        )


def _zip_directory_size(archive: Path) -> tuple[int, int] | None:
    """``(entries, central directory bytes)`` from a zip's end record (zip64 too)."""
    with archive.open("rb") as handle:
        handle.seek(0, 2)
        length = handle.tell()
        handle.seek(max(0, length - (22 + 0xFFFF)))  # the record, then a comment of up to 64 KiB
        tail = handle.read()
        at = tail.rfind(b"PK\x05\x06")
        if at < 0 or len(tail) - at < 22:
            return None
        entries, size, offset = struct.unpack("<10xHLL2x", tail[at : at + 22])
        if entries != 0xFFFF and size != 0xFFFFFFFF and offset != 0xFFFFFFFF:
            return entries, size
        locator = tail[at - 20 : at] if at >= 20 else b""
        if not locator.startswith(b"PK\x06\x07"):
            return entries, size
        (record_at,) = struct.unpack("<8xQ4x", locator)
        handle.seek(record_at)
        record = handle.read(56)
        if len(record) < 56 or not record.startswith(b"PK\x06\x06"):
            return entries, size
        entries64, size64 = struct.unpack("<32xQQ8x", record)
        return entries64, size64


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
    def members(self) -> Iterator[_Member]:
        """The archive's members, one at a time, as they are read."""
        raise NotImplementedError

    def open(self, member: _Member) -> IO[bytes]:
        raise NotImplementedError


class _BoundedTarInfo(tarfile.TarInfo):
    """A tar header that refuses, before reading them, extension headers past the caps and
    sparse files (whose maps tarfile also reads whole)."""

    _EXTENSIONS = (
        tarfile.GNUTYPE_LONGNAME,
        tarfile.GNUTYPE_LONGLINK,
        tarfile.XHDTYPE,
        tarfile.XGLTYPE,
        tarfile.SOLARIS_XHDTYPE,
    )

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in self._EXTENSIONS:
            if self.size > MAX_HEADER_BYTES:
                raise UnsafeArchiveError(
                    f"the archive has a {self.size}-byte long-name or PAX header (more than "
                    f"{MAX_HEADER_BYTES}); refused"
                )
            chain = getattr(tarfile_, "_loragate_chain", 0) + 1
            if chain > MAX_HEADER_CHAIN:
                raise UnsafeArchiveError(
                    f"the archive has more than {MAX_HEADER_CHAIN} extension headers in a row; "
                    "refused"
                )
            tarfile_._loragate_chain = chain  # type: ignore[attr-defined]
        else:
            tarfile_._loragate_chain = 0  # type: ignore[attr-defined]
        if self.type == tarfile.GNUTYPE_SPARSE:
            _refuse_sparse()
        return super()._proc_member(tarfile_)  # type: ignore[misc]

    def _proc_gnusparse_00(self, *args: object) -> None:
        _refuse_sparse()

    def _proc_gnusparse_01(self, *args: object) -> None:
        _refuse_sparse()

    def _proc_gnusparse_10(self, *args: object) -> None:
        _refuse_sparse()


def _refuse_sparse() -> None:
    raise UnsafeArchiveError("the archive holds a sparse file; refused")


class _TarReader(_Reader):
    def __init__(self, tar: tarfile.TarFile) -> None:
        self.tar = tar
        self.by_name: dict[str, tarfile.TarInfo] = {}

    def members(self) -> Iterator[_Member]:
        while (info := self.tar.next()) is not None:
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
            yield _Member(name, info.isdir(), 0 if info.isdir() else info.size)

    def open(self, member: _Member) -> IO[bytes]:
        handle = self.tar.extractfile(self.by_name[member.name])
        if handle is None:
            raise UnsafeArchiveError(f"archive member {member.name!r} has no data")
        return handle


class _ZipReader(_Reader):
    def __init__(self, archive: zipfile.ZipFile) -> None:
        self.zip = archive
        self.by_name: dict[str, zipfile.ZipInfo] = {}

    def members(self) -> Iterator[_Member]:
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
            yield _Member(name, info.is_dir(), 0 if info.is_dir() else info.file_size)

    def open(self, member: _Member) -> IO[bytes]:
        return self.zip.open(self.by_name[member.name])


@contextmanager
def _open(archive: Path, kind: str) -> Iterator[_Reader]:
    if kind == "zip":
        with zipfile.ZipFile(archive) as handle:
            yield _ZipReader(handle)
    else:
        with tarfile.open(archive, "r:*", tarinfo=_BoundedTarInfo) as handle:
            yield _TarReader(handle)
