from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from loragate.adapters.intake.convert import detect_format
from loragate.adapters.intake.sources import SourceError, fetch_source, source_fingerprint
from tests.adapter_fixtures import (
    llama_lora_shapes,
    make_hostile_tar,
    make_symlink_zip,
    make_tar,
    make_tinker_archive,
    make_zip,
    peft_config,
    write_safetensors,
    write_shaped_adapter,
)
from tests.source_networks import sources_may_reach

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def adapter_dir(tmp_path: Path) -> Path:
    """A small adapter-shaped directory (the archive tests need files, not real weights)."""
    src = tmp_path / "src-adapter"
    src.mkdir()
    (src / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    write_safetensors(src / "adapter_model.safetensors", {"w": ("F32", (64, 64))})
    return src


@pytest.fixture
def peft_dir(tmp_path: Path) -> Path:
    """A PEFT adapter for a tiny Llama (zero weights): enough to build a Tinker export from."""
    base = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
    }
    return write_shaped_adapter(
        tmp_path / "peft", llama_lora_shapes(base, modules=("q_proj",)), peft_config()
    )


def _leftovers(parent: Path, dest: Path) -> list[str]:
    """Anything a refused fetch left behind: dest's contents and staging dirs beside it."""
    found = [p.name for p in parent.iterdir() if p.name.startswith(f".{dest.name}")]
    if dest.exists():
        found += [p.name for p in dest.iterdir()]
    return found


# -- local sources ---------------------------------------------------------------------------


def test_local_directory_is_used_in_place_with_a_fingerprint(
    adapter_dir: Path, tmp_path: Path
) -> None:
    fetched = fetch_source(str(adapter_dir), tmp_path / "dest")
    assert fetched.path == adapter_dir.resolve()
    assert fetched.kind == "local"
    assert fetched.provenance.fingerprint == source_fingerprint(str(adapter_dir))
    assert not (tmp_path / "dest").exists()


def test_local_directory_fingerprint_changes_when_a_file_changes(adapter_dir: Path) -> None:
    before = source_fingerprint(str(adapter_dir))
    assert source_fingerprint(str(adapter_dir)) == before
    config = adapter_dir / "adapter_config.json"
    config.write_text(json.dumps({"r": 16, "lora_alpha": 32}))
    os.utime(config, ns=(1, 1))
    assert source_fingerprint(str(adapter_dir)) != before


@pytest.mark.parametrize("name", ["a.tar", "a.tar.gz", "a.tgz"])
def test_local_tar_archive_is_unpacked_and_its_top_folder_unwrapped(
    adapter_dir: Path, tmp_path: Path, name: str
) -> None:
    archive = make_tar(adapter_dir, tmp_path / name)
    fetched = fetch_source(str(archive), tmp_path / "dest")
    assert fetched.kind == "archive"
    assert fetched.path == tmp_path / "dest" / "adapter"
    assert sorted(p.name for p in fetched.path.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert (fetched.path / "adapter_model.safetensors").read_bytes() == (
        adapter_dir / "adapter_model.safetensors"
    ).read_bytes()


def test_local_zip_archive_is_unpacked(adapter_dir: Path, tmp_path: Path) -> None:
    archive = make_zip(adapter_dir, tmp_path / "a.zip", top=None)
    fetched = fetch_source(str(archive), tmp_path / "dest")
    assert fetched.path == tmp_path / "dest"
    assert (fetched.path / "adapter_config.json").read_text() == (
        adapter_dir / "adapter_config.json"
    ).read_text()


def test_archive_can_be_unpacked_into_an_existing_empty_directory(
    adapter_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "dest").mkdir()
    fetched = fetch_source(str(make_tar(adapter_dir, tmp_path / "a.tar")), tmp_path / "dest")
    assert (fetched.path / "adapter_config.json").is_file()


@pytest.mark.parametrize(
    ("trick", "reason"),
    [
        ("traversal", r"outside the archive \(\.\.\)"),
        ("absolute", "absolute path"),
        ("symlink", "is a link"),
        ("hardlink", "is a link"),
        ("device", "device, FIFO"),
    ],
)
def test_hostile_tar_is_refused_and_leaves_nothing(tmp_path: Path, trick: str, reason: str) -> None:
    archive = make_hostile_tar(tmp_path / "evil.tar", trick)
    dest = tmp_path / "work" / "dest"
    with pytest.raises(SourceError, match=reason):
        fetch_source(str(archive), dest)
    assert _leftovers(dest.parent, dest) == []
    assert not (tmp_path / "escaped.txt").exists()
    assert not Path("/tmp/loragate-escaped.txt").exists()


def test_symlink_in_zip_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "work" / "dest"
    with pytest.raises(SourceError, match="is a link"):
        fetch_source(str(make_symlink_zip(tmp_path / "evil.zip")), dest)
    assert _leftovers(dest.parent, dest) == []


def test_archive_larger_than_the_cap_is_refused(adapter_dir: Path, tmp_path: Path) -> None:
    archive = make_tar(adapter_dir, tmp_path / "a.tar.gz")
    dest = tmp_path / "work" / "dest"
    with pytest.raises(SourceError, match="more than the limit 1000"):
        fetch_source(str(archive), dest, max_bytes=1000)
    assert _leftovers(dest.parent, dest) == []


def test_archive_with_too_many_members_is_refused(adapter_dir: Path, tmp_path: Path) -> None:
    for index in range(5):
        (adapter_dir / f"extra{index}.txt").write_text("x")
    dest = tmp_path / "work" / "dest"
    with pytest.raises(SourceError, match="members, more than the limit 3"):
        fetch_source(str(make_tar(adapter_dir, tmp_path / "a.tar")), dest, max_members=3)
    assert _leftovers(dest.parent, dest) == []


def test_damaged_archive_is_refused(adapter_dir: Path, tmp_path: Path) -> None:
    archive = make_tar(adapter_dir, tmp_path / "a.tar.gz")
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    dest = tmp_path / "work" / "dest"
    with pytest.raises(SourceError, match="damaged archive"):
        fetch_source(str(archive), dest)
    assert _leftovers(dest.parent, dest) == []


def test_file_that_is_not_an_archive_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(SourceError, match="not a directory or"):
        fetch_source(str(tmp_path / "notes.txt"), tmp_path / "dest")


def test_missing_local_source_is_refused_naming_the_forms(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="hf://"):
        fetch_source(str(tmp_path / "nope"), tmp_path / "dest")


# -- HTTP(S) ---------------------------------------------------------------------------------


@dataclass
class ArchiveServer:
    """A local HTTP server for archives, with ETag, Range/If-Range and a way to cut a transfer."""

    files: dict[str, bytes] = field(default_factory=dict)
    cut_next_after: int | None = None
    pause_between_quarters: float = 0.0  # > 0: the body comes in four pieces, this far apart
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    url: str = ""

    def etag(self, path: str) -> str:
        return '"' + hashlib.sha256(self.files[path]).hexdigest()[:16] + '"'


def _handler(server: ArchiveServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            self._answer(send_body=False)

        def do_GET(self) -> None:
            self._answer(send_body=True)

        def _answer(self, send_body: bool) -> None:
            path = self.path.split("?", 1)[0]
            server.requests.append((self.command, self.path, dict(self.headers)))
            if path not in server.files:
                self.send_error(404)
                return
            body, etag = server.files[path], server.etag(path)
            start, status = 0, 200
            wanted = self.headers.get("Range")
            if wanted and self.headers.get("If-Range") in (None, etag):
                start, status = int(wanted.removeprefix("bytes=").split("-")[0]), 206
            self.send_response(status)
            self.send_header("ETag", etag)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(body) - start))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
            self.end_headers()
            if not send_body:
                return
            payload = body[start:]
            if server.cut_next_after is not None:
                # Send part of the body, then drop the connection mid-transfer.
                payload, server.cut_next_after = payload[: server.cut_next_after], None
            if not server.pause_between_quarters:
                self.wfile.write(payload)
                return
            quarter = -(-len(payload) // 4)
            for at in range(0, len(payload), quarter):
                self.wfile.write(payload[at : at + quarter])
                self.wfile.flush()
                time.sleep(server.pause_between_quarters)

    return Handler


@pytest.fixture
def archive_server() -> Iterator[ArchiveServer]:
    state = ArchiveServer()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        with sources_may_reach("127.0.0.0/8"):  # the operator's own store, on loopback here
            yield state
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_https_archive_is_downloaded_unpacked_and_its_etag_recorded(
    archive_server: ArchiveServer, adapter_dir: Path, tmp_path: Path
) -> None:
    archive_server.files["/adapter.tar.gz"] = make_tar(
        adapter_dir, tmp_path / "a.tar.gz"
    ).read_bytes()
    url = f"{archive_server.url}/adapter.tar.gz"
    fetched = fetch_source(url, tmp_path / "work" / "dest", progress=False)
    assert fetched.kind == "url"
    assert fetched.etag == archive_server.etag("/adapter.tar.gz")
    assert fetched.provenance.fingerprint == fetched.etag == source_fingerprint(url)
    assert (fetched.path / "adapter_config.json").is_file()
    assert [p.name for p in (tmp_path / "work").iterdir()] == ["dest"]  # no .part left


def test_interrupted_download_resumes_with_range_and_if_range(
    archive_server: ArchiveServer, adapter_dir: Path, tmp_path: Path
) -> None:
    body = make_tar(adapter_dir, tmp_path / "a.tar").read_bytes()
    archive_server.files["/adapter.tar"] = body
    archive_server.cut_next_after = 5000
    url = f"{archive_server.url}/adapter.tar?X-Signature=secret"
    work = tmp_path / "work"
    with pytest.raises(SourceError, match="run it again to resume") as caught:
        fetch_source(url, work / "dest1", progress=False, download_dir=work / "downloads")
    assert "secret" not in str(caught.value)
    parts = list((work / "downloads").glob("*.part"))
    assert len(parts) == 1 and parts[0].stat().st_size == 5000

    fetched = fetch_source(url, work / "dest2", progress=False, download_dir=work / "downloads")
    method, _, headers = archive_server.requests[-1]
    assert (method, headers.get("Range"), headers.get("If-Range")) == (
        "GET",
        "bytes=5000-",
        archive_server.etag("/adapter.tar"),
    )
    assert (fetched.path / "adapter_model.safetensors").read_bytes() == (
        adapter_dir / "adapter_model.safetensors"
    ).read_bytes()
    assert list((work / "downloads").iterdir()) == []


def test_resume_after_the_file_changed_starts_over(
    archive_server: ArchiveServer, adapter_dir: Path, tmp_path: Path
) -> None:
    archive_server.files["/adapter.tar"] = make_tar(adapter_dir, tmp_path / "a.tar").read_bytes()
    archive_server.cut_next_after = 3000
    url = f"{archive_server.url}/adapter.tar"
    with pytest.raises(SourceError):
        fetch_source(url, tmp_path / "d1", progress=False)
    (adapter_dir / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 4}))
    archive_server.files["/adapter.tar"] = make_tar(adapter_dir, tmp_path / "b.tar").read_bytes()
    fetched = fetch_source(url, tmp_path / "d2", progress=False)
    assert archive_server.requests[-1][2].get("Range") == "bytes=3000-"  # asked, but got a 200
    assert json.loads((fetched.path / "adapter_config.json").read_text()) == {
        "r": 4,
        "lora_alpha": 4,
    }
    assert fetched.etag == archive_server.etag("/adapter.tar")


def test_download_larger_than_the_cap_is_refused_before_reading_it(
    archive_server: ArchiveServer, tmp_path: Path
) -> None:
    archive_server.files["/big.tar"] = bytes(50_000)
    dest = tmp_path / "work" / "dest"
    with pytest.raises(SourceError, match="more than the limit of 10000 bytes"):
        fetch_source(f"{archive_server.url}/big.tar", dest, progress=False, max_bytes=10_000)
    assert list((tmp_path / "work").iterdir()) == []


def test_http_error_names_the_status_without_the_signature(
    archive_server: ArchiveServer, tmp_path: Path
) -> None:
    with pytest.raises(SourceError, match="HTTP 404") as caught:
        fetch_source(
            f"{archive_server.url}/missing.tar?sig=topsecret", tmp_path / "dest", progress=False
        )
    assert "topsecret" not in str(caught.value)


def test_downloaded_file_that_is_not_an_archive_is_refused(
    archive_server: ArchiveServer, tmp_path: Path
) -> None:
    archive_server.files["/page.html"] = b"<html>login</html>"
    with pytest.raises(SourceError, match=r"not a tar, tar\.gz or zip"):
        fetch_source(f"{archive_server.url}/page.html", tmp_path / "work" / "dest", progress=False)
    assert list((tmp_path / "work").iterdir()) == []


# -- Hugging Face ----------------------------------------------------------------------------


@pytest.fixture
def fake_hub(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    adapter_dir: Path,
    archive_server: ArchiveServer,
) -> list[dict[str, Any]]:
    """snapshot_download answered from a fake cache: records its calls, returns snapshots/<sha>.

    The hub's API is ``archive_server`` (a tree listing is a file put there; none: 404), so
    nothing asks huggingface.co.
    """
    import huggingface_hub
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", archive_server.url)
    calls: list[dict[str, Any]] = []

    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        snapshot = tmp_path / "hub" / repo_id.replace("/", "--") / "snapshots" / SHA
        if not snapshot.exists():
            (snapshot / "sub" / "dir").mkdir(parents=True)
            for target in (snapshot, snapshot / "sub" / "dir"):
                for item in adapter_dir.iterdir():
                    (target / item.name).symlink_to(item)  # the hub cache links to blobs
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_hf_source_pins_the_revision_and_reports_the_commit(
    fake_hub: list[dict[str, Any]], tmp_path: Path
) -> None:
    fetched = fetch_source("hf://acme/lora@v1.2", tmp_path / "dest", progress=False)
    assert fake_hub[0]["repo_id"] == "acme/lora"
    assert fake_hub[0]["revision"] == "v1.2"
    assert (fetched.commit, fetched.provenance.revision, fetched.provenance.fingerprint) == (
        SHA,
        SHA,
        SHA,
    )
    assert fetched.path == tmp_path / "dest"
    copied = fetched.path / "adapter_config.json"
    assert copied.is_file() and not copied.is_symlink()


def test_hf_source_revision_argument_is_used_when_the_source_has_none(
    fake_hub: list[dict[str, Any]], tmp_path: Path
) -> None:
    fetch_source("hf://acme/lora", tmp_path / "dest", revision="main", progress=False)
    assert fake_hub[0]["revision"] == "main"


def test_hf_source_subdirectory_is_fetched_alone(
    fake_hub: list[dict[str, Any]], tmp_path: Path
) -> None:
    fetched = fetch_source("hf://acme/lora@abc/sub/dir", tmp_path / "dest", progress=False)
    assert fake_hub[0]["allow_patterns"] == ["sub/dir/**", "sub/dir/*"]
    assert sorted(p.name for p in fetched.path.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]


def hub_listing(files: dict[str, int]) -> bytes:
    """The hub's answer to ``GET /api/models/REPO/tree/REV?recursive=True``: path -> size."""
    return json.dumps(
        [
            {"type": "file", "path": path, "size": size, "oid": "0" * 40}
            for path, size in files.items()
        ]
    ).encode()


def test_hf_source_the_hub_lists_larger_than_the_cap_is_refused_before_downloading(
    fake_hub: list[dict[str, Any]], archive_server: ArchiveServer, tmp_path: Path
) -> None:
    archive_server.files["/api/models/acme/huge/tree/main"] = hub_listing(
        {"adapter_config.json": 300, "adapter_model.safetensors": 3 * 1024**3}
    )
    with pytest.raises(SourceError, match=r"3221225772 bytes of files, more than the limit"):
        fetch_source("hf://acme/huge", tmp_path / "dest", progress=False, max_bytes=2 * 1024**3)
    assert fake_hub == []  # nothing was downloaded
    assert archive_server.requests[0][1].startswith("/api/models/acme/huge/tree/main?")
    assert _leftovers(tmp_path, tmp_path / "dest") == []


def test_hf_source_within_the_listed_cap_is_fetched(
    fake_hub: list[dict[str, Any]], archive_server: ArchiveServer, tmp_path: Path
) -> None:
    archive_server.files["/api/models/acme/lora/tree/main"] = hub_listing(
        {"adapter_config.json": 300, "adapter_model.safetensors": 17_000}
    )
    fetched = fetch_source("hf://acme/lora", tmp_path / "dest", progress=False, max_bytes=99_000)
    assert (fetched.path / "adapter_model.safetensors").is_file() and len(fake_hub) == 1


def test_hf_source_larger_than_the_cap_is_refused_when_the_hub_lists_no_sizes(
    fake_hub: list[dict[str, Any]], adapter_dir: Path, tmp_path: Path
) -> None:
    # No listing (the hub answers 404, as when it cannot be asked): the copy counts the bytes.
    size = sum(p.stat().st_size for p in adapter_dir.iterdir())
    source = "hf://acme/lora/sub/dir"  # the fake repo holds the adapter there once
    with pytest.raises(SourceError, match=f"more than the limit of {size - 1} bytes"):
        fetch_source(source, tmp_path / "dest", progress=False, max_bytes=size - 1)
    assert _leftovers(tmp_path, tmp_path / "dest") == []
    fetched = fetch_source(source, tmp_path / "dest", progress=False, max_bytes=size)
    assert (fetched.path / "adapter_model.safetensors").is_file()


def test_hf_source_on_a_full_disk_raises_enospc_not_a_source_error(
    fake_hub: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import huggingface_hub

    def full_disk(repo_id: str, **kwargs: Any) -> str:
        with open("/dev/full", "wb") as handle:  # the hub cache's disk filled up
            handle.write(b"weights")
            handle.flush()
        return ""

    monkeypatch.setattr(huggingface_hub, "snapshot_download", full_disk)
    with pytest.raises(OSError) as caught:  # the pipeline answers it with a 507
        fetch_source("hf://acme/lora", tmp_path / "dest", progress=False)
    assert caught.value.errno == errno.ENOSPC and not isinstance(caught.value, SourceError)


def test_hf_source_with_two_different_revisions_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="pins revision 'v1'"):
        fetch_source("hf://acme/lora@v1", tmp_path / "dest", revision="v2")


def test_malformed_hf_source_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="hf://ORG/REPO"):
        fetch_source("hf://just-a-name", tmp_path / "dest")


def test_hf_source_offline_and_not_cached_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(repo_id: str, **kwargs: Any) -> str:
        raise LocalEntryNotFoundError("not cached")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(SourceError, match="HF_HUB_OFFLINE='1'"):
        fetch_source("hf://acme/lora", tmp_path / "dest")


def test_hf_fingerprint_is_the_commit_of_the_revision(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    asked: list[tuple[str, str | None]] = []

    class FakeApi:
        def model_info(
            self, repo_id: str, *, revision: str | None = None, token: Any = None
        ) -> Any:
            asked.append((repo_id, revision))
            return types.SimpleNamespace(sha=SHA)

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    assert source_fingerprint("hf://acme/lora@main") == SHA
    assert asked == [("acme/lora", "main")]
    assert source_fingerprint(f"hf://acme/lora@{SHA}") == SHA  # a commit needs no question
    assert len(asked) == 1


# -- Tinker ----------------------------------------------------------------------------------


def test_tinker_source_without_the_sdk_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "tinker", None)
    with pytest.raises(SourceError, match=r"pip install 'loragate\[tinker\]'"):
        fetch_source("tinker://run-1/sampler_weights/final", tmp_path / "dest")


def test_malformed_tinker_source_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="tinker://RUN/sampler_weights/NAME"):
        fetch_source("tinker://run-1/checkpoints/final", tmp_path / "dest")


def test_tinker_source_through_an_sdk_with_the_archive_method(
    monkeypatch: pytest.MonkeyPatch, peft_dir: Path, tmp_path: Path
) -> None:
    """SDKs up to about 0.6 had RestClient.get_checkpoint_archive_url_from_tinker_path."""
    archive = make_tinker_archive(peft_dir, tmp_path / "ckpt.tar", tmp_path)
    asked: list[str] = []

    class RestClient:
        def get_checkpoint_archive_url_from_tinker_path(self, path: str) -> Any:
            asked.append(path)
            return types.SimpleNamespace(
                result=lambda: types.SimpleNamespace(url="https://storage.test/ckpt.tar?sig=1")
            )

    monkeypatch.setitem(sys.modules, "tinker", types.SimpleNamespace(RestClient=RestClient))
    with _respx() as router:
        router.get("https://storage.test/ckpt.tar").respond(
            200, content=archive.read_bytes(), headers={"ETag": '"e1"'}
        )
        fetched = fetch_source(
            "tinker://run-1/sampler_weights/final", tmp_path / "dest", progress=False
        )
    assert asked == ["tinker://run-1/sampler_weights/final"]
    assert detect_format(fetched.path) == "tinker"
    assert (fetched.path / "checkpoint_complete").exists()
    assert fetched.provenance.revision == "tinker://run-1/sampler_weights/final"


TINKER_BASE = "http://tinker.test"
CHECKPOINTS = {
    "checkpoints": [
        {
            "checkpoint_id": f"sampler_weights/{name}",
            "checkpoint_type": "sampler",
            "time": f"2026-01-0{day}T00:00:00Z",
            "tinker_path": f"tinker://run-1/sampler_weights/{name}",
        }
        for day, name in ((1, "000010"), (2, "000020"))
    ],
    "cursor": None,
}


@pytest.fixture
def tinker_sdk(monkeypatch: pytest.MonkeyPatch) -> Any:
    tinker = pytest.importorskip("tinker")
    monkeypatch.setenv("TINKER_API_KEY", "tml-test-key")
    monkeypatch.setenv("TINKER_BASE_URL", TINKER_BASE)
    return tinker


def training_run(user_metadata: dict[str, str] | None) -> dict[str, Any]:
    """``GET /api/v1/training_runs/RUN`` as Tinker answers it (``tinker.types.TrainingRun``)."""
    return {
        "training_run_id": "run-1",
        "base_model": "Qwen/Qwen3-8B",
        "model_owner": "someone",
        "is_lora": True,
        "lora_rank": 8,
        "last_request_time": "2026-01-02T00:00:00Z",
        "user_metadata": user_metadata,
    }


def _tinker_routes(router: Any, user_metadata: dict[str, str] | None = None) -> None:
    # The SDK asks for its client config first; turning pyqwest off keeps it on httpx (respx).
    router.post(f"{TINKER_BASE}/api/v1/client/config").respond(
        200, json={"use_pyqwest_transport": False}
    )
    router.get(f"{TINKER_BASE}/api/v1/training_runs/run-1").respond(
        200, json=training_run(user_metadata)
    )
    router.post(f"{TINKER_BASE}/api/v1/client/dynamic_config").respond(404, json={"detail": "none"})
    router.get(f"{TINKER_BASE}/api/v1/training_runs/run-1/checkpoints").respond(
        200, json=CHECKPOINTS
    )
    router.post(url__startswith=f"{TINKER_BASE}/api/v1/telemetry").respond(200, json={})


@pytest.mark.timeout(60)  # the SDK retries unexpected failures for minutes
def test_tinker_latest_sampler_checkpoint_is_fetched_through_the_real_sdk(
    tinker_sdk: Any, peft_dir: Path, tmp_path: Path
) -> None:
    archive = make_tinker_archive(peft_dir, tmp_path / "ckpt.tar", tmp_path)
    with _respx() as router:
        _tinker_routes(router)
        archive_route = router.get(
            f"{TINKER_BASE}/api/v1/training_runs/run-1/checkpoints/sampler_weights/000020/archive"
        ).respond(
            302, headers={"Location": "https://storage.test/bucket/ckpt.tar?X-Goog-Signature=s"}
        )
        router.get("https://storage.test/bucket/ckpt.tar").respond(
            200, content=archive.read_bytes(), headers={"ETag": '"v20"'}
        )
        fetched = fetch_source(
            "tinker://run-1/sampler_weights/latest", tmp_path / "dest", progress=False
        )
        marker = source_fingerprint("tinker://run-1/sampler_weights/latest")
    assert archive_route.calls.last.request.headers["X-API-Key"] == "tml-test-key"
    assert fetched.provenance.revision == "tinker://run-1/sampler_weights/000020"
    assert fetched.provenance.fingerprint == marker
    assert marker is not None and marker.startswith(
        "tinker://run-1/sampler_weights/000020@2026-01-02"
    )
    assert detect_format(fetched.path) == "tinker"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "user_metadata, renderer",
    [({"renderer_name": "qwen3"}, "qwen3"), ({"other": "x"}, None), (None, None)],
    ids=["named", "other-metadata", "no-metadata"],
)
def test_a_tinker_runs_renderer_comes_with_the_checkpoint(
    tinker_sdk: Any,
    peft_dir: Path,
    tmp_path: Path,
    user_metadata: dict[str, str] | None,
    renderer: str | None,
) -> None:
    """tinker-cookbook records the renderer a run trained with as ``renderer_name`` in the
    training run's ``user_metadata`` (``checkpoint_utils.py``); it travels with the fetch."""
    archive = make_tinker_archive(peft_dir, tmp_path / "ckpt.tar", tmp_path)
    with _respx() as router:
        _tinker_routes(router, user_metadata)
        router.get(
            f"{TINKER_BASE}/api/v1/training_runs/run-1/checkpoints/sampler_weights/000010/archive"
        ).respond(302, headers={"Location": "https://storage.test/ckpt.tar?sig=1"})
        router.get("https://storage.test/ckpt.tar").respond(200, content=archive.read_bytes())
        fetched = fetch_source(
            "tinker://run-1/sampler_weights/000010", tmp_path / "dest", progress=False
        )
    assert fetched.renderer == renderer
    assert detect_format(fetched.path) == "tinker"


@pytest.mark.timeout(60)
def test_tinker_external_weights_are_fetched_file_by_file_through_the_real_sdk(
    tinker_sdk: Any, adapter_dir: Path, tmp_path: Path
) -> None:
    files = {
        name: (adapter_dir / name).read_bytes()
        for name in ("adapter_config.json", "adapter_model.safetensors")
    }
    urls = {name: f"https://storage.test/ext/{name}?sig=1" for name in files}
    with _respx() as router:
        _tinker_routes(router)
        router.get(
            f"{TINKER_BASE}/api/v1/training_runs/run-1/checkpoints/external_weights/final/external_weights_urls"
        ).respond(200, json={"urls": urls, "expires": "2099-01-01T00:00:00Z"})
        for name, body in files.items():
            router.get(f"https://storage.test/ext/{name}").respond(
                200, content=body, headers={"ETag": '"x"'}
            )
        fetched = fetch_source(
            "tinker://run-1/external_weights/final", tmp_path / "dest", progress=False
        )
    for name, body in files.items():
        assert (fetched.path / name).read_bytes() == body


@pytest.mark.timeout(60)
def test_tinker_archive_refusal_is_explained(tinker_sdk: Any, tmp_path: Path) -> None:
    with _respx() as router:
        _tinker_routes(router)
        router.get(
            f"{TINKER_BASE}/api/v1/training_runs/run-1/checkpoints/sampler_weights/000010/archive"
        ).respond(404, json={"detail": "not found"})
        with pytest.raises(SourceError, match="HTTP 404") as caught:
            fetch_source("tinker://run-1/sampler_weights/000010", tmp_path / "dest", progress=False)
    assert "external_weights" in str(caught.value)


def _respx() -> Any:
    respx = pytest.importorskip("respx")
    return respx.mock(assert_all_called=False, assert_all_mocked=True)


# ----- a server that trickles ----------------------------------------------------------------


@pytest.fixture
def trickling_url() -> Iterator[str]:
    """A server that promises 1 MB and sends one byte every 50 ms: never silent, never done."""

    class Trickle(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 20))
            self.send_header("ETag", '"trickle"')
            self.end_headers()
            try:
                for _ in range(1 << 20):
                    self.wfile.write(b"\0")
                    self.wfile.flush()
                    stop.wait(0.05)
                    if stop.is_set():
                        return
            except OSError:
                return

        def log_message(self, *args: Any) -> None:
            pass

    stop = threading.Event()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with sources_may_reach("127.0.0.0/8"):
            yield f"http://127.0.0.1:{httpd.server_address[1]}/slow.tar.gz?sig=secret"
    finally:
        stop.set()
        httpd.shutdown()
        httpd.server_close()


def test_a_trickling_download_fails_clearly_at_its_deadline(
    trickling_url: str, tmp_path: Path
) -> None:
    started = time.monotonic()
    with pytest.raises(SourceError, match=r"did not finish within 1 s") as caught:
        # The per-read timeout never fires: a byte arrives every 50 ms.
        fetch_source(trickling_url, tmp_path / "dest", progress=False, timeout=30, deadline=1.0)
    elapsed = time.monotonic() - started
    assert elapsed < 5, elapsed
    assert "run it again to resume" in str(caught.value)
    assert "secret" not in str(caught.value)
    assert not (tmp_path / "dest").exists()


# ----- leaks: credentials in messages, shared partial downloads ------------------------------


def test_download_errors_show_neither_user_password_nor_signature(
    archive_server: ArchiveServer, tmp_path: Path
) -> None:
    url = archive_server.url.replace("http://", "http://alice:hunter2@")
    with pytest.raises(SourceError, match="HTTP 404") as caught:
        fetch_source(f"{url}/missing.tar?sig=topsecret", tmp_path / "dest", progress=False)
    message = str(caught.value)
    assert "hunter2" not in message and "alice" not in message and "topsecret" not in message
    assert "http://***@127.0.0.1:" in message and "/missing.tar?***" in message


def test_a_partial_download_resumes_only_for_the_very_same_url(
    archive_server: ArchiveServer, adapter_dir: Path, tmp_path: Path
) -> None:
    archive_server.files["/adapter.tar"] = make_tar(adapter_dir, tmp_path / "a.tar").read_bytes()
    archive_server.cut_next_after = 3000
    work = tmp_path / "work"
    with pytest.raises(SourceError):
        fetch_source(
            f"{archive_server.url}/adapter.tar?variant=1",
            work / "d1",
            progress=False,
            download_dir=work / "downloads",
        )
    # Another query can name other content: it starts afresh instead of resuming the first.
    fetch_source(
        f"{archive_server.url}/adapter.tar?variant=2",
        work / "d2",
        progress=False,
        download_dir=work / "downloads",
    )
    assert archive_server.requests[-1][1] == "/adapter.tar?variant=2"
    assert "Range" not in archive_server.requests[-1][2]


def test_two_fetches_of_one_url_at_once_take_turns_on_its_partial_download(
    archive_server: ArchiveServer, adapter_dir: Path, tmp_path: Path
) -> None:
    (adapter_dir / "padding.bin").write_bytes(os.urandom(400_000))
    archive_server.files["/adapter.tar"] = make_tar(adapter_dir, tmp_path / "a.tar").read_bytes()
    archive_server.pause_between_quarters = 0.1
    url = f"{archive_server.url}/adapter.tar"
    work = tmp_path / "work"
    results: dict[str, Any] = {}

    def fetch(name: str) -> None:
        try:
            results[name] = fetch_source(
                url, work / name, progress=False, download_dir=work / "downloads"
            )
        except Exception as exc:
            results[name] = exc

    threads = [threading.Thread(target=fetch, args=(name,)) for name in ("one", "two")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for name in ("one", "two"):
        fetched = results[name]
        assert not isinstance(fetched, Exception), f"{name}: {fetched!r}"
        assert (fetched.path / "padding.bin").read_bytes() == (
            adapter_dir / "padding.bin"
        ).read_bytes()


def test_hf_source_comes_from_the_users_hub_cache_unless_an_earlier_loragate_kept_it(
    fake_hub: list[dict[str, Any]], tmp_path: Path
) -> None:
    legacy = tmp_path / "store" / "hf"  # where loragate downloaded hf:// sources before
    fetch_source("hf://acme/lora", tmp_path / "a", progress=False, hf_cache_dir=legacy)
    (legacy / "models--acme--old").mkdir(parents=True)
    fetch_source("hf://acme/old", tmp_path / "b", progress=False, hf_cache_dir=legacy)
    assert [call["cache_dir"] for call in fake_hub] == [None, legacy]


def test_a_source_in_an_unknown_users_home_is_a_clear_error(tmp_path: Path) -> None:
    """The fuzzer found ``~user`` of a user that does not exist: a 500 before."""
    with pytest.raises(SourceError, match="home directory of an unknown user"):
        fetch_source("~no-such-user-4e1f/adapter", tmp_path / "dest")


# -- bare hub ids (org/repo, as vLLM's --lora-modules takes them) ------------------------------


def test_bare_hub_id_is_fetched_from_the_hub(
    fake_hub: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no local acme/lora here
    fetched = fetch_source("acme/lora@v1.2", tmp_path / "dest", progress=False)
    assert (fake_hub[0]["repo_id"], fake_hub[0]["revision"]) == ("acme/lora", "v1.2")
    assert (fetched.path / "adapter_config.json").is_file()
    fetch_source("acme/lora", tmp_path / "dest2", progress=False)
    assert fake_hub[1]["repo_id"] == "acme/lora"


def test_bare_id_that_is_a_local_directory_is_used_in_place(
    fake_hub: list[dict[str, Any]], adapter_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(adapter_dir.parent)
    local = adapter_dir.parent / "acme" / "lora"
    local.mkdir(parents=True)
    for item in adapter_dir.iterdir():
        (local / item.name).write_bytes(item.read_bytes())
    assert fetch_source("acme/lora", adapter_dir.parent / "dest3").path.resolve() == local
    assert fake_hub == []


@pytest.mark.parametrize(
    "missing", ["/srv/acme/lora", "./acme/lora", "~/acme/lora", "a/b/c", "acme/lora.tar.gz"]
)
def test_missing_path_that_looks_like_a_path_still_says_it_is_missing(
    fake_hub: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SourceError, match="not an existing directory or archive"):
        fetch_source(missing, tmp_path / "dest")
    assert fake_hub == []
