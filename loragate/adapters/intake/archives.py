"""Unpack an adapter archive (tar, tar.gz, tar.bz2, tar.xz, zip) without trusting it.

Only regular files and directories are unpacked. A tar is unpacked by ``tarfile`` under its
``data`` extraction filter (PEP 706), which refuses members that would land outside ``dest``,
links pointing outside it, devices and FIFOs, and drops setuid, setgid and group/other write
bits and the archive's owners. Stricter than that filter, an absolute name is refused (the
filter would strip its ``/``) and so is every link, even one pointing inside: an adapter needs
none, zip archives get the same refusal, and the filter's checks of link targets had bypasses
in Pythons before 3.11.13, 3.12.11 and 3.13.4 (CVE-2025-4138, CVE-2025-4517). A zip is unpacked
here member by member under the same name rules (``_safe_name``).

Everything is unpacked into a private staging directory that is renamed onto ``dest`` only
when the whole archive passed, so a refused archive leaves nothing.

The limits hold while the archive is read, not after: members are counted as they are read
and the count stops at the cap; a tar's long-name and PAX headers are refused past
``MAX_HEADER_BYTES`` before ``tarfile`` reads them (``_TarHeaderGuard`` checks each header of
the uncompressed stream before handing it over); and a zip's central directory is sized from
its end record before ``zipfile`` parses it. A small ``.tar.gz`` of millions of empty entries
or one huge header fails fast in little memory.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import re
import shutil
import stat
import struct
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

DEFAULT_MAX_BYTES = 2 * 1024**3
DEFAULT_MAX_MEMBERS = 10_000
# A long name or PAX record set this large is no adapter's: refused before it is read.
MAX_HEADER_BYTES = 64 * 1024
# Extension headers (long name, long link, PAX) in a row before a member: a few at most.
MAX_HEADER_CHAIN = 8
# Central directory bytes allowed per member (46 fixed + name + extra + comment).
_ZIP_DIRECTORY_BYTES_PER_MEMBER = 1024
_CHUNK = 1 << 20
# How a compressed tar starts, and what opens it as the uncompressed stream.
_TAR_COMPRESSIONS: dict[bytes, Callable[[Path], io.BufferedIOBase]] = {
    b"\x1f\x8b": gzip.GzipFile,
    b"BZh": bz2.BZ2File,
    b"\xfd7zXZ\x00": lzma.LZMAFile,
}


class UnsafeArchiveError(ValueError):
    """The archive is not a plain tree of files within the limits; nothing was unpacked."""


def archive_kind(path: Path) -> str | None:
    """``"zip"``, ``"tar"`` (plain or compressed) or None, judged by content, not by name."""
    with path.open("rb") as handle:
        head = handle.read(512)
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "zip"
    if any(head.startswith(magic) for magic in _TAR_COMPRESSIONS):
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
    tally = _Tally(archive.name, max_bytes, max_members)
    try:
        if kind == "zip":
            _unpack_zip(archive, staging, tally)
        else:
            _unpack_tar(archive, staging, tally)
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


@dataclass
class _Tally:
    """The member count and unpacked bytes so far, refused past the caps."""

    archive_name: str
    max_bytes: int
    max_members: int
    members: int = 0
    declared: int = 0
    written: int = 0

    def member(self, size: int) -> None:
        """One more member, of ``size`` bytes as its header declares."""
        self.members += 1
        if self.members > self.max_members:
            raise UnsafeArchiveError(
                f"the archive has too many members, more than the limit {self.max_members}"
            )
        self.declared += size
        if self.declared > self.max_bytes:
            raise UnsafeArchiveError(
                f"the archive unpacks to more than the limit {self.max_bytes} bytes"
            )

    def wrote(self, count: int) -> None:
        """``count`` more bytes written (a zip's declared sizes are not binding)."""
        self.written += count
        if self.written > self.max_bytes:
            raise UnsafeArchiveError(
                f"{self.archive_name} unpacks to more than {self.max_bytes} bytes; refused"
            )


def _refuse_clash(staging: Path, name: str, is_dir: bool) -> None:
    """Refuse a member whose path needs a file where a directory was unpacked, or the other way
    round (``a`` and ``a/b``): the file system would raise ``FileExistsError`` or
    ``IsADirectoryError``, which says nothing about the archive. A file given twice is allowed
    (the later copy wins, as with ``tar -x``)."""
    target = staging.joinpath(*PurePosixPath(name).parts)
    for parent in target.relative_to(staging).parents:
        if parent != Path(".") and (staging / parent).is_file():
            raise UnsafeArchiveError(
                f"archive member {name!r} is inside {parent.as_posix()!r}, which the "
                "archive also holds as a file; refused"
            )
    if target.is_dir() != is_dir and target.exists():
        held = "a directory" if target.is_dir() else "a file"
        raise UnsafeArchiveError(
            f"archive member {name!r} is also in the archive as {held}; refused"
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


def _refuse_special(name: str) -> UnsafeArchiveError:
    return UnsafeArchiveError(
        f"archive member {name!r} is a device, FIFO or other special file; refused"
    )


# -- tar ------------------------------------------------------------------------------------


def _unpack_tar(archive: Path, staging: Path, tally: _Tally) -> None:
    opener = next(
        (open_ for magic, open_ in _TAR_COMPRESSIONS.items() if _starts_with(archive, magic)),
        lambda path: path.open("rb"),
    )
    with opener(archive) as uncompressed:
        guard = _TarHeaderGuard(uncompressed)
        # "r|": read as a stream, one member at a time, never seeking back.
        with tarfile.open(fileobj=guard, mode="r|") as tar:
            for info in tar:
                guard.confirm(info)
                tally.member(info.size if info.isreg() else 0)
                tar.extract(info, staging, filter=_adapter_member)


def _starts_with(path: Path, magic: bytes) -> bool:
    with path.open("rb") as handle:
        return handle.read(len(magic)) == magic


def _adapter_member(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """The ``tarfile`` extraction filter: the name rules, then ``tarfile.data_filter``, then no
    links, and no name used both as a file and as a directory. None skips the archive's
    top directory entry (``./``)."""
    name = _safe_name(member.name)
    if not name:
        return None
    try:
        filtered = tarfile.data_filter(member, dest)
    except tarfile.AbsoluteLinkError:
        raise UnsafeArchiveError(
            f"archive member {member.name!r} is a link to the absolute path "
            f"{member.linkname!r}; refused"
        ) from None
    except tarfile.LinkOutsideDestinationError:
        raise UnsafeArchiveError(
            f"archive member {member.name!r} is a link to {member.linkname!r}, outside the "
            "archive; refused"
        ) from None
    except tarfile.SpecialFileError:
        raise _refuse_special(member.name) from None
    except tarfile.AbsolutePathError:
        raise UnsafeArchiveError(
            f"archive member {member.name!r} has an absolute path; refused"
        ) from None
    except tarfile.OutsideDestinationError:
        raise UnsafeArchiveError(
            f"archive member {member.name!r} points outside the archive; refused"
        ) from None
    if filtered.issym() or filtered.islnk():
        raise UnsafeArchiveError(
            f"archive member {member.name!r} is a link (to {member.linkname!r}); an adapter "
            "holds plain files only; refused"
        )
    if not (filtered.isreg() or filtered.isdir()):
        raise _refuse_special(member.name)
    _refuse_clash(Path(dest), name, filtered.isdir())
    return filtered


_EXTENSION_TYPES = (
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
)
_PAX_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)
_PAX_RECORD = re.compile(rb"(\d+) ([^=]+)=")
# Bytes ``tarfile`` may read past the archive's end block: its stream buffer, read ahead.
_READ_AHEAD = 2 * tarfile.RECORDSIZE


def _blocks(size: int) -> int:
    """``size`` bytes rounded up to whole tar blocks."""
    return -(-max(size, 0) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


class _TarHeaderGuard(io.RawIOBase):
    """The uncompressed tar stream as ``tarfile`` reads it, each header checked before
    ``tarfile`` gets it: an extension header (long name, long link, PAX) over
    ``MAX_HEADER_BYTES`` or more than ``MAX_HEADER_CHAIN`` of them in a row, and sparse files
    (whose maps ``tarfile`` would also read whole), are refused before their bytes are read.

    It walks the headers as ``tarfile`` does (a header's data follows it, rounded to blocks; a
    PAX ``size`` record moves the next header), and ``confirm`` checks for each member
    ``tarfile`` returns that both walks agree: a disagreement is refused, never trusted.
    After the end block it hands over ``tarfile``'s read-ahead, then refuses more.
    """

    def __init__(self, source: io.BufferedIOBase) -> None:
        super().__init__()
        self._source = source
        self._offset = 0  # of the next byte taken from the source
        self._checked = bytearray()  # header bytes checked, not yet handed over
        self._data_left = 0  # member data (padded) before the next header
        self._chain = 0
        self._pax_size: int | None = None  # set by a PAX header for the member it precedes
        self._after_end: int | None = None  # bytes handed over past the end block
        self._members: dict[int, int] = {}  # data offset -> size, of members not yet confirmed

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        while not self._checked and not self._data_left and self._after_end is None:
            self._check_header()
        if self._checked:
            count = min(len(buffer), len(self._checked))
            buffer[:count] = self._checked[:count]
            del self._checked[:count]
            return count
        wanted = len(buffer) if self._after_end is not None else self._data_left
        block = self._take(min(len(buffer), wanted, _CHUNK))
        if self._after_end is not None:
            self._after_end += len(block)
            if self._after_end > _READ_AHEAD:
                raise UnsafeArchiveError(
                    "the archive's headers do not add up: more of it is read past its end; refused"
                )
        else:
            self._data_left = 0 if not block else self._data_left - len(block)
        buffer[: len(block)] = block
        return len(block)

    def confirm(self, info: tarfile.TarInfo) -> None:
        """Refuse ``info`` unless this walk found a member whose data starts where ``tarfile``
        says, with the size it says."""
        size = self._members.pop(info.offset_data, None)
        if size is None or (info.isreg() and size != info.size):
            raise UnsafeArchiveError(
                f"the archive's headers disagree about where member {info.name!r} and its "
                "data are; refused"
            )

    def _take(self, count: int) -> bytes:
        try:
            block = self._source.read(count)
        except (OSError, EOFError, lzma.LZMAError, zlib.error) as exc:
            raise tarfile.ReadError(f"its compressed data is damaged: {exc}") from exc
        self._offset += len(block)
        return block

    def _take_exactly(self, count: int) -> bytes:
        pieces = []
        while count and (piece := self._take(count)):
            pieces.append(piece)
            count -= len(piece)
        return b"".join(pieces)

    def _check_header(self) -> None:
        block = self._take_exactly(tarfile.BLOCKSIZE)
        self._checked += block
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError:  # the end block, or what tarfile also takes for the end
            self._after_end = 0
            return
        if info.type == tarfile.GNUTYPE_SPARSE:
            raise _refuse_sparse()
        if info.type in _EXTENSION_TYPES:
            if info.size > MAX_HEADER_BYTES:
                raise UnsafeArchiveError(
                    f"the archive has a {info.size}-byte long-name or PAX header (more than "
                    f"{MAX_HEADER_BYTES}); refused"
                )
            self._chain += 1
            if self._chain > MAX_HEADER_CHAIN:
                raise UnsafeArchiveError(
                    f"the archive has more than {MAX_HEADER_CHAIN} extension headers in a row; "
                    "refused"
                )
            body = self._take_exactly(_blocks(info.size))
            self._checked += body
            if info.type in _PAX_TYPES:
                self._check_pax(info.type, body)
            return
        self._chain = 0
        size = info.size if self._pax_size is None else self._pax_size
        self._pax_size = None
        self._members[self._offset] = size
        if info.isreg() or info.type not in tarfile.SUPPORTED_TYPES:
            self._data_left = _blocks(size)  # tarfile skips no data after other types

    def _check_pax(self, kind: bytes, body: bytes) -> None:
        """Refuse sparse files and a global size; keep a member's own size record (the
        outermost PAX header's wins, as in ``tarfile``)."""
        records: dict[bytes, bytes] = {}
        at = 0
        while match := _PAX_RECORD.match(body, at):
            length = int(match.group(1))
            if length == 0:
                self._after_end = 0  # tarfile refuses the header: nothing more is read
                return
            records[match.group(2)] = body[match.end(2) + 1 : match.start(1) + length - 1]
            at += length
        if any(key.startswith(b"GNU.sparse.") for key in records):
            raise _refuse_sparse()
        if b"size" not in records:
            return
        if kind == tarfile.XGLTYPE:
            raise UnsafeArchiveError(
                "the archive sets every member's size in a global header; refused"
            )
        try:
            size = int(records[b"size"].decode("utf-8", "surrogateescape"))
        except ValueError:
            size = 0  # as tarfile reads it
        if size < 0:
            raise UnsafeArchiveError("the archive gives a member a negative size; refused")
        if self._pax_size is None:
            self._pax_size = size


def _refuse_sparse() -> UnsafeArchiveError:
    return UnsafeArchiveError("the archive holds a sparse file; refused")


# -- zip ------------------------------------------------------------------------------------


def _unpack_zip(archive: Path, staging: Path, tally: _Tally) -> None:
    _check_zip_directory(archive, tally.max_members)
    with zipfile.ZipFile(archive) as handle:
        for info in handle.infolist():
            name = _safe_name(info.filename)
            mode = info.external_attr >> 16
            if stat.S_ISLNK(mode):
                raise UnsafeArchiveError(f"archive member {info.filename!r} is a link; refused")
            # Unix type bits are optional in zip files; judge them only when present.
            kind = stat.S_IFMT(mode)
            if kind and kind not in (stat.S_IFREG, stat.S_IFDIR):
                raise _refuse_special(info.filename)
            if info.flag_bits & 0x1:
                raise UnsafeArchiveError(f"archive member {info.filename!r} is encrypted; refused")
            if not name:
                continue
            tally.member(0 if info.is_dir() else info.file_size)
            _refuse_clash(staging, name, info.is_dir())
            target = staging.joinpath(*PurePosixPath(name).parts)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with handle.open(info) as source, target.open("wb") as sink:
                while block := source.read(_CHUNK):
                    tally.wrote(len(block))
                    sink.write(block)


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
