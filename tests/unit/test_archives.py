"""Archive limits hold while an archive is read: a small hostile file fails fast in little memory."""

from __future__ import annotations

import gzip
import io
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
