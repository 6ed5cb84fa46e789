"""Adapter sources, the fleet manifest and hub endpoints reach no loopback, private or
link-local address unless the operator named its network (``allowed_source_networks``).

Real servers on 127.0.0.1 record every request: a refused source must leave them untouched.
"""

from __future__ import annotations

import io
import tarfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import pytest

from loragate.adapters.errors import AdapterError
from loragate.adapters.fleet_manifest import FleetManifestError, fetch_fleet_manifest
from loragate.adapters.intake.pipeline import AdapterPipeline
from loragate.adapters.intake.sources import SourceError, fetch_source, source_fingerprint
from loragate.adapters.store import AdapterStore
from loragate.fetching.hub import check_hub_endpoint
from loragate.http.addresses import AllowedNetworks
from loragate.settings import Settings
from tests.source_networks import sources_may_reach

MANIFEST = b'{"adapters": {"a": {"source": "hf://org/a"}}}'


@dataclass
class Recorder:
    port: int = 0
    paths: list[str] = field(default_factory=list)
    redirect_to: str | None = None


def _archive() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        data = b"{}"
        info = tarfile.TarInfo("adapter/adapter_config.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.fixture
def server() -> Iterator[Recorder]:
    state = Recorder()
    archive = _archive()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            state.paths.append(self.path)
            if state.redirect_to is not None and self.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", state.redirect_to)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = MANIFEST if self.path.endswith(".json") else archive
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("ETag", '"v1"')
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.port = httpd.server_address[1]
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()


def _refused(exc: pytest.ExceptionInfo[Exception]) -> None:
    message = str(exc.value)
    assert "allowed_source_networks" in message and "--allowed-source-networks" in message


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1", "2130706433", "0x7f000001", "127.1", "[::ffff:127.0.0.1]", "localhost"],
)
def test_a_loopback_archive_url_in_any_form_is_refused_before_a_request(
    server: Recorder, tmp_path: Path, host: str
) -> None:
    with pytest.raises(SourceError) as exc:
        fetch_source(f"http://{host}:{server.port}/a.tar.gz", tmp_path / "out")
    _refused(exc)
    assert server.paths == []
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("host", ["169.254.169.254", "10.0.0.1", "192.168.1.1", "[fd00::1]"])
def test_metadata_and_private_addresses_are_refused_without_connecting(
    tmp_path: Path, host: str
) -> None:
    with pytest.raises(SourceError) as exc:
        fetch_source(f"http://{host}/latest/meta-data/", tmp_path / "out", timeout=60)
    _refused(exc)
    with pytest.raises(SourceError) as exc:
        source_fingerprint(f"http://{host}/latest/meta-data/")
    _refused(exc)


def test_an_allowed_network_is_fetched(server: Recorder, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{server.port}/a.tar.gz"
    with sources_may_reach("127.0.0.0/8"):
        fetched = fetch_source(url, tmp_path / "out")
        assert source_fingerprint(url) == '"v1"'
    assert (fetched.path / "adapter_config.json").read_bytes() == b"{}"
    assert server.paths == ["/a.tar.gz", "/a.tar.gz"]


def test_each_redirect_hop_is_checked(server: Recorder, tmp_path: Path) -> None:
    # Only the name "localhost" is allowed: its redirect to 127.0.0.1 itself is not.
    server.redirect_to = f"http://127.0.0.1:{server.port}/a.tar.gz"
    with sources_may_reach("localhost"), pytest.raises(SourceError) as exc:
        fetch_source(f"http://localhost:{server.port}/redirect", tmp_path / "out")
    _refused(exc)
    assert server.paths == ["/redirect"]


def test_the_pipeline_refuses_with_an_adapter_error_naming_the_setting(
    server: Recorder, tmp_path: Path
) -> None:
    pipeline = AdapterPipeline(AdapterStore(tmp_path / "store"), tmp_path, {}, 16)
    with pytest.raises(AdapterError) as exc:
        pipeline.prepare(f"http://127.0.0.1:{server.port}/a.tar.gz")
    assert exc.value.code == "adapter_source_error"
    assert "allowed_source_networks" in str(exc.value)
    assert server.paths == []


def test_a_fleet_manifest_url_gets_the_same_policy(server: Recorder) -> None:
    url = f"http://127.0.0.1:{server.port}/adapters.json"
    with pytest.raises(FleetManifestError) as exc:
        fetch_fleet_manifest(url)
    assert "allowed_source_networks" in str(exc.value)
    assert server.paths == []
    with pytest.raises(FleetManifestError, match="allowed_source_networks"):
        fetch_fleet_manifest("http://169.254.169.254/adapters.json")
    with sources_may_reach("127.0.0.1/32"):
        assert fetch_fleet_manifest(url) == MANIFEST


def test_a_private_hub_endpoint_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://169.254.169.254")
    with pytest.raises(SourceError, match="allowed_source_networks"):
        check_hub_endpoint()
    with sources_may_reach("169.254.0.0/16"):
        check_hub_endpoint()


def test_the_setting_takes_networks_and_host_names() -> None:
    settings = Settings(allowed_source_networks="10.0.0.0/8, artifacts.internal")
    allowed = settings.source_networks()
    assert allowed.refused("10.1.2.3", [ip_address("10.1.2.3")]) is None
    assert allowed.refused("artifacts.internal", []) is None
    assert allowed.refused("x", [ip_address("::ffff:10.9.9.9")]) is None
    assert allowed.refused("x", [ip_address("192.168.0.1")]) == ip_address("192.168.0.1")
    assert AllowedNetworks().refused("x", [ip_address("8.8.8.8")]) is None
    with pytest.raises(ValueError, match="neither a network"):
        Settings(allowed_source_networks=["10.0.0.0/8", "not a host!"])
