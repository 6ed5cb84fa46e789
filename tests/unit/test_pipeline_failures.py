"""Whatever goes wrong on an adapter's way into the store is an ``AdapterError`` with a reason.

The fleet reconciler, boot and the admin API catch only ``AdapterError``: before, a number that
overflows (``rank_pattern: {q_proj: Infinity}``), an archive that uses one name as a file and
as a directory, or a full disk escaped as a plain exception (a plain-text 500 from the admin
API, an aborted reconcile pass) and left partial downloads behind. Real files throughout;
the full disk is a write that raises ``ENOSPC`` half-way.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import tarfile
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PosixPath
from typing import Any

import httpx
import pytest

import loragate.adapters.intake.downloads as downloads_module
import loragate.adapters.intake.validate as validate_module
import loragate.adapters.store as store_module
from loragate.adapters.errors import AdapterError
from loragate.adapters.intake.pipeline import AdapterPipeline
from loragate.adapters.store import AdapterStore
from loragate.gateway.app import create_app
from tests.adapter_fixtures import make_tar
from tests.backend_double import ManagedBackendDouble, settings_for
from tests.source_networks import sources_may_reach
from tests.unit.test_provenance import TINY_LLAMA, make_manager, tiny_adapter

ADMIN_KEY = "the-admin"


def pipeline_in(tmp_path: Path) -> AdapterPipeline:
    return AdapterPipeline(AdapterStore(tmp_path / "store"), tmp_path / "base", TINY_LLAMA, 16)


def prepare_error(pipeline: AdapterPipeline, source: str | Path) -> AdapterError:
    with pytest.raises(AdapterError) as caught:
        pipeline.prepare(str(source))
    return caught.value


def nothing_left_in(store: AdapterStore) -> list[str]:
    """What a failed prepare left in the store: versions, work dirs, partial downloads."""
    left = [p.name for p in store.versions.iterdir()] + [p.name for p in store.tmp.iterdir()]
    downloads = store.root / "downloads"
    if downloads.exists():
        left += [p.name for p in downloads.iterdir()]
    return left


def test_a_rank_pattern_of_infinity_is_refused_naming_the_field(tmp_path: Path) -> None:
    adapter = tiny_adapter(tmp_path / "fox")
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["rank_pattern"] = {"q_proj": float("inf")}
    (adapter / "adapter_config.json").write_text(json.dumps(config))  # writes Infinity
    assert "Infinity" in (adapter / "adapter_config.json").read_text()
    pipeline = pipeline_in(tmp_path)

    error = prepare_error(pipeline, adapter)  # was: OverflowError out of int(inf)
    assert error.code == "adapter_rejected" and error.status == 400
    assert "rank_pattern['q_proj'] must be a positive whole number, got inf" in str(error)
    assert nothing_left_in(pipeline.store) == []


def clashing_tar(adapter: Path, archive: Path, *, file_first: bool) -> Path:
    """The adapter, plus ``adapter/extra`` both as a file and as a directory holding a file."""
    make_tar(adapter, archive)
    as_file = ("adapter/extra", b"a file")
    inside = ("adapter/extra/inner", b"a file in a directory of the same name")
    with tarfile.open(archive, "a") as tar:
        for name, data in [as_file, inside] if file_first else [inside, as_file]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return archive


@pytest.mark.parametrize(
    ("file_first", "reason"),
    [
        (True, "which the archive also holds as a file"),
        (False, "also in the archive as a directory"),
    ],
    ids=["file-then-directory", "directory-then-file"],
)
def test_an_archive_using_a_name_as_file_and_directory_is_refused(
    tmp_path: Path, file_first: bool, reason: str
) -> None:
    archive = clashing_tar(
        tiny_adapter(tmp_path / "fox"), tmp_path / "fox.tar", file_first=file_first
    )
    pipeline = pipeline_in(tmp_path)

    error = prepare_error(pipeline, archive)  # was: FileExistsError / IsADirectoryError
    assert error.code == "adapter_source_error" and error.status == 400
    assert "'adapter/extra" in str(error) and reason in str(error)
    assert nothing_left_in(pipeline.store) == []


def test_any_other_failure_is_an_adapter_error_with_its_type_and_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The safety net for what no check foresaw (here: a bug in validation).
    def broken(*args: Any) -> None:
        raise KeyError("hidden_size")

    monkeypatch.setattr(validate_module, "validate_adapter", broken)
    pipeline = pipeline_in(tmp_path)
    error = prepare_error(pipeline, tiny_adapter(tmp_path / "fox"))
    assert error.status == 500 and error.code == "adapter_unexpected_error"
    assert "could not be prepared: KeyError: 'hidden_size'" in str(error)
    assert nothing_left_in(pipeline.store) == []


# ----- a full disk ------------------------------------------------------------------------------


class _FullAfterFirstWrite(io.RawIOBase):
    """A file on a disk that fills up: the first write lands, the next raises ENOSPC."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.writes = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.writes += 1
        if self.writes > 1:
            raise OSError(errno.ENOSPC, "No space left on device", self.real.name)
        return int(self.real.write(data))

    def close(self) -> None:
        self.real.close()
        super().close()


class _OnAFullDisk(PosixPath):
    def open(self, mode: str = "r", *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        handle = super().open(mode, *args, **kwargs)
        return _FullAfterFirstWrite(handle) if "w" in mode or "a" in mode else handle


@pytest.fixture
def archive_url(tmp_path: Path) -> Iterator[str]:
    """A tar.gz of a good adapter (bigger than one read), served over HTTP on loopback."""
    adapter = tiny_adapter(tmp_path / "served", rank=8)
    (adapter / "padding.bin").write_bytes(os.urandom(512 * 1024))  # several reads' worth
    body = make_tar(adapter, tmp_path / "served.tar.gz").read_bytes()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("ETag", '"v1"')
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        with sources_may_reach("127.0.0.0/8"):  # the operator's own store, on loopback here
            yield f"http://127.0.0.1:{httpd.server_address[1]}/fox.tar.gz"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
async def admin_with_a_real_manager(
    tmp_path: Path,
) -> AsyncIterator[tuple[httpx.AsyncClient, AdapterStore]]:
    """The admin API of a gateway whose adapter manager and pipeline are the real ones."""
    store = AdapterStore(tmp_path / "store")
    backend = ManagedBackendDouble()
    backend.adapters = make_manager(  # type: ignore[assignment]
        tmp_path, store, AdapterPipeline(store, tmp_path / "base", TINY_LLAMA, 16)
    )
    settings = settings_for(
        tmp_path / "cache", admin_key=ADMIN_KEY, adapter_source_roots=[tmp_path]
    )
    app = create_app(settings, backend=backend)
    # raise_app_exceptions=False: an escaped exception reads as the plain-text 500 a client sees.
    transport = httpx.ASGITransport(app, raise_app_exceptions=False)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client,
    ):
        yield client, store
    await backend.adapters.aclose()  # type: ignore[attr-defined]


async def put_adapter(client: httpx.AsyncClient, source: str) -> httpx.Response:
    return await client.put(
        "/admin/adapters/fox",
        json={"source": source},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )


def assert_no_space_error(response: httpx.Response) -> None:
    assert response.status_code == 507, response.text
    error = response.json()["error"]  # OpenAI-style, not "Internal Server Error"
    assert error["code"] == "insufficient_storage" and error["type"] == "api_error"
    assert "no space left on device" in error["message"]
    assert "free disk space" in error["message"]


async def test_a_full_disk_during_a_download_is_a_507_and_leaves_no_partial_file(
    admin_with_a_real_manager: tuple[httpx.AsyncClient, AdapterStore],
    archive_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, store = admin_with_a_real_manager
    real_stream_to = downloads_module._stream_to

    def onto_a_full_disk(part: Path, *args: Any) -> None:
        real_stream_to(_OnAFullDisk(part), *args)

    monkeypatch.setattr(downloads_module, "_stream_to", onto_a_full_disk)
    assert_no_space_error(await put_adapter(client, archive_url))
    assert nothing_left_in(store) == []  # no .part, no .part.json, no work dir

    monkeypatch.undo()  # space again: the same source now stores and serves
    response = await put_adapter(client, archive_url)
    assert response.status_code == 200 and response.json()["state"] == "ready"


async def test_a_full_disk_while_storing_is_a_507_and_leaves_nothing_staged(
    admin_with_a_real_manager: tuple[httpx.AsyncClient, AdapterStore],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, store = admin_with_a_real_manager
    real_copyfile = shutil.copyfile

    def copy_until_full(src: Any, dst: Any, **kwargs: Any) -> Any:
        if Path(dst).is_relative_to(store.tmp):
            Path(dst).write_bytes(Path(src).read_bytes()[:100])
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real_copyfile(src, dst, **kwargs)

    monkeypatch.setattr(store_module.shutil, "copyfile", copy_until_full)
    assert_no_space_error(await put_adapter(client, str(tiny_adapter(tmp_path / "fox"))))
    assert nothing_left_in(store) == []
