"""Secrets stay where they are needed: not in what the API shows, not in the engine, not in a proxy."""

from __future__ import annotations

import http.server
import json
import socketserver
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loragate import cli_admin
from loragate.adapters.intake.pipeline import PreparedVersion
from loragate.adapters.manager import AdapterError, AdapterManager
from loragate.adapters.manifest import Manifest
from loragate.adapters.provenance import Provenance
from loragate.adapters.store import AdapterStore
from loragate.adapters.watch import StoreWatch
from loragate.logs import redact, redact_urls
from loragate.supervisor.client import EngineClient
from loragate.supervisor.command import EngineSpec, engine_env
from loragate.supervisor.engine import EngineEndpoint
from tests.engine_doubles import QuietEngine, ServingSupervisor

SIGNED = "https://alice:hunter2@bucket.example/adapters/a.tar.gz?X-Amz-Signature=topsecret"
SECRETS = ("alice", "hunter2", "X-Amz-Signature", "topsecret")


def shows_no_secret(text: str) -> bool:
    return not any(secret in text for secret in SECRETS)


def test_redact_hides_user_password_and_query() -> None:
    assert redact(SIGNED) == "https://***@bucket.example/adapters/a.tar.gz?***"
    assert redact("http://[::1]:8080/a.tar") == "http://[::1]:8080/a.tar"
    assert redact_urls(f"cannot fetch {SIGNED}: HTTP 403.") == (
        "cannot fetch https://***@bucket.example/adapters/a.tar.gz?***: HTTP 403."
    )


# ----- what the admin API and /health show -------------------------------------------------


def adapter_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (path / "adapter_model.safetensors").write_bytes(b"weights")
    return path


async def test_admin_listing_errors_and_health_reasons_show_sources_redacted(
    tmp_path: Path,
) -> None:
    store = AdapterStore(tmp_path / "store")
    stored = store.put_dir(adapter_dir(tmp_path / "src"), {"source": SIGNED})

    source_gone = threading.Event()

    async def prepare(source: str, revision: str | None) -> PreparedVersion:
        if "broken" in source or source_gone.is_set():
            raise AdapterError(f"cannot download {source}: HTTP 403")
        return PreparedVersion(stored, Provenance(source, revision))

    manager = AdapterManager(
        store=store,
        manifest=Manifest(tmp_path / "manifests" / "base.json"),
        engine=QuietEngine(),  # type: ignore[arg-type]
        supervisor=ServingSupervisor(),  # type: ignore[arg-type]
        base_name="base",
        base_config={},
        prepare=prepare,
        zero_adapter_root=None,
    )
    listed = await manager.put("signed", SIGNED)
    assert listed["source"] == "https://***@bucket.example/adapters/a.tar.gz?***"
    assert shows_no_secret(json.dumps(manager.list()))
    with pytest.raises(AdapterError) as caught:
        await manager.put("other", SIGNED.replace("a.tar.gz", "broken.tar.gz"))
    assert shows_no_secret(str(caught.value))  # the PUT's error, and the follow error
    # A live version damaged on disk whose source is gone: the reason /health shows.
    weights = stored.path / "adapter_model.safetensors"
    weights.chmod(0o644)
    weights.write_bytes(b"tampered")
    source_gone.set()
    assert list(await StoreWatch(manager, store, interval=1).check()) == ["signed"]
    assert "could not be stored again" in manager.failures["signed"]
    assert shows_no_secret(json.dumps(manager.failures))
    await manager.aclose()

    # The real source stays where it is needed to fetch again, readable by the owner only.
    manifest = tmp_path / "manifests" / "base.json"
    assert SIGNED in manifest.read_text()
    assert stat.S_IMODE(manifest.stat().st_mode) == 0o600
    meta = stored.path / ".loragate.json"
    assert stat.S_IMODE(meta.stat().st_mode) == 0o600


# ----- the engine's environment --------------------------------------------------------------


def test_the_engine_inherits_none_of_the_gateways_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "LORAGATE_ADMIN_KEY": "admin-secret",
        "LORAGATE_API_KEY": "api-secret",
        "LORAGATE_UPSTREAM_API_KEY": "upstream-secret",
        "DATATURE_VI_SECRET_KEY": "vi-secret",
        "LORAGATE_BENCH_ENGINE_CPUS": "0,1",
        "HF_TOKEN": "hf-token",
    }.items():
        monkeypatch.setenv(name, value)
    spec = EngineSpec(
        model="m",
        served_name="m",
        socket_path=Path("/tmp/engine.sock"),
        api_key="per-boot",
        max_loras=1,
        max_lora_rank=8,
    )
    env = engine_env(spec)
    assert not any(value.endswith("-secret") for value in env.values())
    assert not [name for name in env if name.startswith("LORAGATE_") and "BENCH" not in name]
    assert env["LORAGATE_BENCH_ENGINE_CPUS"] == "0,1"  # the bench's engine wrapper reads it
    assert env["HF_TOKEN"] == "hf-token" and env["VLLM_API_KEY"] == "per-boot"


# ----- loopback clients and HTTP(S)_PROXY ------------------------------------------------------


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class Listener:
    """A loopback HTTP listener that records each request's path and Authorization header."""

    def __init__(self, unix_path: Path | None = None) -> None:
        self.seen: list[tuple[str, str | None]] = []
        seen = self.seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen.append((self.path, self.headers.get("Authorization")))
                body = b'{"data": [{"id": "m"}]}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        if unix_path is not None:  # as the engine listens: on a Unix socket
            self.httpd = _UnixHTTPServer(str(unix_path), Handler)
            self.url = "http://engine"
        else:
            self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def proxy_and_target(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Listener, Listener]]:
    proxy, target = Listener(), Listener()
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "all_proxy"):
        monkeypatch.setenv(name, proxy.url)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    try:
        yield proxy, target
    finally:
        proxy.close()
        target.close()


async def test_the_engine_client_never_sends_the_engine_key_to_a_proxy(
    proxy_and_target: tuple[Listener, Listener], tmp_path: Path
) -> None:
    proxy, _ = proxy_and_target
    engine = Listener(unix_path=tmp_path / "engine.sock")

    class Supervisor:
        endpoint = EngineEndpoint(str(tmp_path / "engine.sock"), "per-boot-key")

    client = EngineClient(Supervisor())  # type: ignore[arg-type]
    try:
        assert await client.served_ids() == {"m"}
    finally:
        await client.aclose()
    engine.close()
    assert engine.seen == [("/v1/models", "Bearer per-boot-key")]
    assert proxy.seen == []


def test_the_cli_never_sends_the_admin_key_to_a_proxy(
    proxy_and_target: tuple[Listener, Listener],
) -> None:
    proxy, gateway = proxy_and_target
    cli_admin.admin_request(gateway.url, "admin-key", "GET", "/admin/adapters")
    assert gateway.seen == [("/admin/adapters", "Bearer admin-key")]
    assert proxy.seen == []
