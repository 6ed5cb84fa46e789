"""Archive limits hold while an archive is read: a small hostile file fails fast in little memory."""

from __future__ import annotations

import gzip
import io
import os
import re
import stat
import struct
import tarfile
import time
import tracemalloc
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loragate.adapters.intake import archives
from loragate.adapters.intake.archives import UnsafeArchiveError, extract_archive


def header(name: str, kind: bytes, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = size
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def write_gz(path: Path, *pieces: tuple[bytes, int]) -> Path:
    """A .tar.gz of each ``(bytes, times)`` piece repeated, then the end-of-archive blocks."""
    with gzip.open(path, "wb", compresslevel=1) as sink:
        for data, times in pieces:
            batch = max(1, (1 << 20) // max(len(data), 1))
            for start in range(0, times, batch):
                sink.write(data * min(batch, times - start))
        sink.write(bytes(1024))
    return path


def measured(call: Callable[[], Any]) -> tuple[BaseException, float, int]:
    """What ``call`` raised, how long it took and the peak of memory it allocated."""
    tracemalloc.start()
    started = time.monotonic()
    try:
        call()
    except BaseException as exc:
        raised = exc
    else:
        raise AssertionError("the archive was accepted")
    finally:
        elapsed = time.monotonic() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return raised, elapsed, peak


def test_a_small_tar_gz_of_very_many_entries_stops_at_the_member_limit(tmp_path: Path) -> None:
    entries = 200_000  # 100 MB of headers, a few hundred kB compressed
    archive = write_gz(tmp_path / "many.tar.gz", (header("f", tarfile.REGTYPE, 0), entries))
    assert archive.stat().st_size < 2_000_000
    raised, elapsed, peak = measured(
        lambda: extract_archive(archive, tmp_path / "dest", max_members=100)
    )
    assert isinstance(raised, UnsafeArchiveError) and "more than the limit 100" in str(raised)
    assert elapsed < 3, f"took {elapsed:.1f} s"
    assert peak < 8 << 20, f"peak {peak >> 20} MiB"  # reading every header took hundreds
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize(
    "kind", [tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE], ids=["gnu-long-name", "pax"]
)
def test_a_huge_long_name_or_pax_header_is_refused_before_it_is_read(
    tmp_path: Path, kind: bytes
) -> None:
    size = 64 << 20
    archive = write_gz(
        tmp_path / "huge-header.tar.gz",
        (header("././@LongLink", kind, size), 1),
        (bytes(1 << 20), size >> 20),
        (header("adapter_config.json", tarfile.REGTYPE, 0), 1),
    )
    raised, _, peak = measured(lambda: extract_archive(archive, tmp_path / "dest"))
    assert isinstance(raised, UnsafeArchiveError) and "header" in str(raised), raised
    assert peak < 8 << 20, f"peak {peak >> 20} MiB"


def test_a_long_chain_of_extension_headers_is_refused(tmp_path: Path) -> None:
    name = b"a" * 100
    block = header("././@LongLink", tarfile.GNUTYPE_LONGNAME, len(name)) + name.ljust(512, b"\0")
    archive = write_gz(tmp_path / "chain.tar.gz", (block, 10_000))
    with pytest.raises(UnsafeArchiveError, match="extension headers in a row"):
        extract_archive(archive, tmp_path / "dest")


def test_ordinary_long_names_still_unpack(tmp_path: Path) -> None:
    source = tmp_path / "src" / ("d" * 120)
    source.mkdir(parents=True)
    (source / "adapter_config.json").write_text("{}")
    archive = tmp_path / "ok.tar.gz"
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        with tarfile.open(archive, "w:gz", format=fmt) as tar:
            tar.add(source, arcname=source.name)
        dest = tmp_path / f"dest-{fmt}"
        extract_archive(archive, dest)
        assert (dest / source.name / "adapter_config.json").read_text() == "{}"


def test_a_zip_with_too_many_entries_is_refused_before_zipfile_reads_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = tmp_path / "many.zip"
    with zipfile.ZipFile(archive, "w") as handle:
        for index in range(50):
            handle.writestr(f"f{index}", b"")

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("zipfile parsed the whole central directory")

    monkeypatch.setattr(archives.zipfile, "ZipFile", never)
    with pytest.raises(UnsafeArchiveError, match="50 members, more than the limit 10"):
        extract_archive(archive, tmp_path / "dest", max_members=10)


def test_a_zip64_end_record_is_read_for_the_entry_count(tmp_path: Path) -> None:
    entries, directory = 3_000_000, 150_000_000
    zip64_record = struct.pack(
        "<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, entries, entries, directory, 0
    )
    local = b"PK\x03\x04" + bytes(26)  # where a (here empty) first member would start
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, len(local), 1)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    archive = tmp_path / "zip64.zip"
    archive.write_bytes(local + zip64_record + locator + end)
    assert archives._zip_directory_size(archive) == (entries, directory)
    with pytest.raises(UnsafeArchiveError, match="3000000 members"):
        extract_archive(archive, tmp_path / "dest")


@pytest.mark.parametrize(
    ("names", "reason"),
    [
        (["a", "a/b"], "'a/b' is inside 'a', which the archive also holds as a file"),
        (["a/b", "a"], "'a' is also in the archive as a directory"),
        (["a/", "a"], "'a' is also in the archive as a directory"),
    ],
    ids=["file-then-inside-it", "inside-then-file", "directory-then-file"],
)
def test_a_name_used_as_file_and_directory_is_refused_and_nothing_unpacked(
    tmp_path: Path, names: list[str], reason: str
) -> None:
    # Before: FileExistsError / IsADirectoryError / NotADirectoryError out of the file system.
    archive = tmp_path / "clash.tar"
    with tarfile.open(archive, "w") as tar:
        for name in names:
            info = tarfile.TarInfo(name.rstrip("/"))
            if name.endswith("/"):
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = 4
                tar.addfile(info, io.BytesIO(b"data"))
    with pytest.raises(UnsafeArchiveError, match=reason):
        extract_archive(archive, tmp_path / "dest")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clash.tar"]


def test_a_file_given_twice_still_unpacks_the_later_copy(tmp_path: Path) -> None:
    archive = tmp_path / "twice.tar"
    with tarfile.open(archive, "w") as tar:
        for data in (b"old", b"new!"):
            info = tarfile.TarInfo("a")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert (extract_archive(archive, tmp_path / "dest") / "a").read_bytes() == b"new!"


# -- the path policy: tarfile's data filter, plus no links and no absolute names ---------------


def tar_of(path: Path, *members: tuple[tarfile.TarInfo, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


def member(name: str, kind: bytes = tarfile.REGTYPE, **fields: Any) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    for key, value in fields.items():
        setattr(info, key, value)
    return info


@pytest.mark.parametrize(
    ("link", "reason"),
    [
        (
            member("a/l", tarfile.SYMTYPE, linkname="../../outside"),
            "is a link to '../../outside', outside",
        ),
        (
            member("a/l", tarfile.LNKTYPE, linkname="../outside"),
            "is a link to '../outside', outside",
        ),
        (member("a/l", tarfile.SYMTYPE, linkname="/etc/passwd"), "is a link to the absolute path"),
        (member("a/l", tarfile.LNKTYPE, linkname="/etc/passwd"), "is a link to the absolute path"),
        (member("a/l", tarfile.SYMTYPE, linkname="f"), r"is a link \(to 'f'\).*plain files only"),
        (
            member("a/l", tarfile.LNKTYPE, linkname="a/f"),
            r"is a link \(to 'a/f'\).*plain files only",
        ),
    ],
    ids=[
        "symlink-out",
        "hardlink-out",
        "symlink-absolute",
        "hardlink-absolute",
        "symlink-in",
        "hardlink-in",
    ],
)
def test_links_are_refused_those_pointing_outside_by_the_data_filter(
    tmp_path: Path, link: tarfile.TarInfo, reason: str
) -> None:
    archive = tar_of(tmp_path / "links.tar", (member("a/f"), b"data"), (link, b""))
    with pytest.raises(UnsafeArchiveError, match=reason):
        extract_archive(archive, tmp_path / "work" / "dest")
    assert list((tmp_path / "work").iterdir()) == []
    assert not (tmp_path / "outside").exists()


@pytest.mark.parametrize(
    "special",
    [
        member("a/null", tarfile.CHRTYPE, devmajor=1, devminor=3),
        member("a/disk", tarfile.BLKTYPE, devmajor=8, devminor=0),
        member("a/pipe", tarfile.FIFOTYPE),
    ],
    ids=["char-device", "block-device", "fifo"],
)
def test_devices_and_fifos_are_refused(tmp_path: Path, special: tarfile.TarInfo) -> None:
    archive = tar_of(tmp_path / "special.tar", (member("a/f"), b"data"), (special, b""))
    with pytest.raises(UnsafeArchiveError, match="is a device, FIFO or other special file"):
        extract_archive(archive, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_an_absolute_name_is_refused_not_stripped(tmp_path: Path) -> None:
    # The data filter alone would unpack "/etc/cron.d/x" as "etc/cron.d/x".
    archive = tar_of(tmp_path / "absolute.tar", (member("/etc/cron.d/x"), b"data"))
    with pytest.raises(UnsafeArchiveError, match=re.escape("'/etc/cron.d/x' has an absolute path")):
        extract_archive(archive, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_setuid_setgid_and_others_write_bits_are_dropped_and_owners_ignored(
    tmp_path: Path,
) -> None:
    archive = tar_of(
        tmp_path / "modes.tar",
        (member("a/tool", mode=0o6777, uid=4242, gid=4242, uname="x", gname="x"), b"#!"),
        (member("a/readonly", mode=0o444), b"data"),
    )
    dest = extract_archive(archive, tmp_path / "dest")
    tool, readonly = (dest / "a" / "tool").stat(), (dest / "a" / "readonly").stat()
    assert stat.S_IMODE(tool.st_mode) == 0o755
    assert stat.S_IMODE(readonly.st_mode) == 0o644  # the owner can still replace it
    assert (tool.st_uid, tool.st_gid) == (os.getuid(), os.getgid())


def test_the_top_directory_entry_and_plain_trees_unpack(tmp_path: Path) -> None:
    archive = tar_of(
        tmp_path / "tree.tar",
        (member("./", tarfile.DIRTYPE), b""),
        (member("./a", tarfile.DIRTYPE, mode=0o777), b""),
        (member("./a/b.json", mode=0o644), b"{}"),
    )
    dest = extract_archive(archive, tmp_path / "dest")
    assert (dest / "a" / "b.json").read_bytes() == b"{}"
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*")) == ["a", "a/b.json"]


@pytest.mark.parametrize("compression", ["gz", "bz2", "xz"])
def test_compressed_tars_unpack(tmp_path: Path, compression: str) -> None:
    archive = tmp_path / f"a.tar.{compression}"
    with tarfile.open(archive, f"w:{compression}") as tar:
        info = tarfile.TarInfo("adapter/adapter_config.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    dest = extract_archive(archive, tmp_path / "dest")
    assert (dest / "adapter" / "adapter_config.json").read_bytes() == b"{}"


def test_damaged_compressed_data_is_called_a_damaged_archive(tmp_path: Path) -> None:
    archive = tmp_path / "a.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        info = tarfile.TarInfo("f")
        info.size = 100_000
        tar.addfile(info, io.BytesIO(os.urandom(100_000)))
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 0xFF
    archive.write_bytes(bytes(data))
    with pytest.raises(UnsafeArchiveError, match="damaged archive"):
        extract_archive(archive, tmp_path / "dest")


# -- headers are walked as tarfile walks them -------------------------------------------------


def pax(kind: bytes, **records: str) -> bytes:
    """A PAX header (``kind`` x or g) and its records, padded to blocks."""
    body = b""
    for key, value in records.items():
        text = f" {key.replace('__', '.')}={value}\n"
        length = len(text) + 1
        while length != len(text) + len(str(length)):  # the length counts its own digits
            length = len(text) + len(str(length))
        body += f"{length}{text}".encode()
    return header("././@PaxHeader", kind, len(body)) + body.ljust(-(-len(body) // 512) * 512, b"\0")


def raw_tar(path: Path, *blocks: bytes) -> Path:
    path.write_bytes(b"".join(blocks) + bytes(1024))
    return path


def test_a_pax_size_record_moves_the_next_header_as_tarfile_reads_it(tmp_path: Path) -> None:
    archive = raw_tar(
        tmp_path / "pax-size.tar",
        pax(tarfile.XHDTYPE, size="4"),
        header("a", tarfile.REGTYPE, 0),  # the header's own size is overridden
        b"data".ljust(512, b"\0"),
        header("b", tarfile.REGTYPE, 2),
        b"ok".ljust(512, b"\0"),
    )
    dest = extract_archive(archive, tmp_path / "dest")
    assert (dest / "a").read_bytes() == b"data" and (dest / "b").read_bytes() == b"ok"


def test_a_size_for_every_member_in_a_global_header_is_refused(tmp_path: Path) -> None:
    archive = raw_tar(
        tmp_path / "global-size.tar",
        pax(tarfile.XGLTYPE, size="4"),
        header("a", tarfile.REGTYPE, 0),
        b"data".ljust(512, b"\0"),
    )
    with pytest.raises(UnsafeArchiveError, match="every member's size in a global header"):
        extract_archive(archive, tmp_path / "dest")


@pytest.mark.parametrize(
    "blocks",
    [
        (header("s", tarfile.GNUTYPE_SPARSE, 0),),
        (pax(tarfile.XHDTYPE, GNU__sparse__map="0,4"), header("s", tarfile.REGTYPE, 4)),
        (pax(tarfile.XHDTYPE, GNU__sparse__major="1", GNU__sparse__minor="0"),),
    ],
    ids=["old-gnu", "pax-0.1", "pax-1.0"],
)
def test_sparse_files_are_refused_before_their_maps_are_read(
    tmp_path: Path, blocks: tuple[bytes, ...]
) -> None:
    archive = raw_tar(tmp_path / "sparse.tar", *blocks, bytes(512))
    with pytest.raises(UnsafeArchiveError, match="sparse file"):
        extract_archive(archive, tmp_path / "dest")


def test_no_private_tarfile_method_is_overridden_or_called() -> None:
    import ast

    tree = ast.parse(Path(archives.__file__).read_text())
    private = [
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and isinstance(node.value, ast.Name)
        and node.value.id in ("tarfile", "tar", "info", "member", "super")
    ]
    subclasses = [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and any(ast.unparse(base).startswith("tarfile.") for base in node.bases)
    ]
    assert (private, subclasses) == ([], [])
