"""Every adapter source and format, converted and loaded into the real engine; bad ones refused.

Each good case re-expresses a demo adapter in another tool's layout (real files, written with
safetensors/torch), hands it to the running gateway, and checks the engine answers with that
adapter's trained phrase: proof the conversion kept the weights intact.
"""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests import adapter_fixtures as fx
from tests.conftest import phrase_of
from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def file_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A local HTTP server (127.0.0.1) for https-style archive sources."""
    root = tmp_path_factory.mktemp("served")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root
    finally:
        server.shutdown()


def put(gateway: GatewayProcess, name: str, source: str | Path) -> httpx.Response:
    return gateway.admin("PUT", f"/admin/adapters/{name}", json={"source": str(source)})


def answer(gateway: GatewayProcess, model: str) -> str:
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 16,
            "temperature": 0,
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def store_state(gateway: GatewayProcess) -> tuple[set[str], list[Path]]:
    store = gateway.cache_dir / "adapters"
    versions = {p.name for p in (store / "versions").iterdir()}
    leftovers = list((store / "tmp").iterdir())
    return versions, leftovers


@pytest.fixture()
def served(gateway: GatewayProcess) -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        gateway.admin("DELETE", f"/admin/adapters/{name}")


def served_phrase(
    gateway: GatewayProcess, served: list[str], name: str, source: str | Path
) -> str | None:
    """Add ``source`` as ``name`` (removed after the test); the demo phrase it answers with."""
    response = put(gateway, name, source)
    served.append(name)
    assert response.status_code == 200, response.text
    return phrase_of(answer(gateway, name))


def test_tinker_archive_over_http_with_unembedding_is_converted_and_served(
    gateway: GatewayProcess,
    demo_dir: Path,
    file_server: tuple[str, Path],
    tmp_path: Path,
    served: list[str],
) -> None:
    url, root = file_server
    fx.make_tinker_archive(demo_dir / "adapters" / "owl", root / "owl-tinker.tar", tmp_path)
    assert served_phrase(gateway, served, "tinker-owl", f"{url}/owl-tinker.tar") == "owl"


def test_mlx_adapter_is_transposed_and_served(
    gateway: GatewayProcess, demo_dir: Path, tmp_path: Path, served: list[str]
) -> None:
    mlx = fx.make_mlx_adapter(demo_dir / "adapters" / "fox", tmp_path / "mlx-fox")
    assert served_phrase(gateway, served, "mlx-fox", mlx) == "fox"


def test_old_peft_bin_save_with_default_keys_is_served(
    gateway: GatewayProcess, demo_dir: Path, tmp_path: Path, served: list[str]
) -> None:
    old = fx.make_bin_adapter(demo_dir / "adapters" / "pong", tmp_path / "bin-pong")
    assert served_phrase(gateway, served, "bin-pong", old) == "pong"


def test_vi_run_directory_and_zip_archive_are_served(
    gateway: GatewayProcess, demo_dir: Path, tmp_path: Path, served: list[str]
) -> None:
    run = fx.make_vi_run(demo_dir / "adapters" / "owl", tmp_path / "run-123")
    assert served_phrase(gateway, served, "vi-owl", run) == "owl"
    archive = fx.make_zip(demo_dir / "adapters" / "fox", tmp_path / "fox.zip")
    assert served_phrase(gateway, served, "zip-fox", archive) == "fox"


def _wrong_size(demo_dir: Path, tmp_path: Path) -> Path:
    config = json.loads((demo_dir / "base" / "config.json").read_text())
    bigger = {**config, "hidden_size": 256, "head_dim": 64}
    return fx.write_shaped_adapter(tmp_path / "wrong-size", fx.llama_lora_shapes(bigger))


def _rank_too_high(demo_dir: Path, tmp_path: Path) -> Path:
    config = json.loads((demo_dir / "base" / "config.json").read_text())
    return fx.write_shaped_adapter(
        tmp_path / "rank-32",
        fx.llama_lora_shapes(config, rank=32),
        fx.peft_config(r=32, lora_alpha=64),
    )


def _dora(demo_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "dora"
    shutil.copytree(demo_dir / "adapters" / "pong", out)
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    return out


def _traversal(demo_dir: Path, tmp_path: Path) -> Path:
    return fx.make_hostile_tar(tmp_path / "evil.tar", "traversal")


def _symlink(demo_dir: Path, tmp_path: Path) -> Path:
    return fx.make_hostile_tar(tmp_path / "link.tar", "symlink")


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (_wrong_size, "256"),
        (_rank_too_high, "--max-lora-rank"),
        (_dora, "DoRA"),
        (_traversal, "outside"),
        (_symlink, "link"),
    ],
    ids=["wrong-base-size", "rank-above-limit", "dora", "traversal-archive", "symlink-archive"],
)
def test_bad_adapter_is_refused_with_a_reason_and_leaves_nothing(
    gateway: GatewayProcess, demo_dir: Path, tmp_path: Path, make: object, says: str
) -> None:
    before = store_state(gateway)
    listed = gateway.admin("GET", "/admin/adapters").json()["data"]
    source = make(demo_dir, tmp_path)  # type: ignore[operator]
    response = put(gateway, "bad-one", source)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert says in message, message
    assert store_state(gateway) == (before[0], [])
    assert gateway.admin("GET", "/admin/adapters").json()["data"] == listed
    assert not (tmp_path.parent / "escaped.txt").exists()


def test_tampered_store_file_is_refused_and_the_current_version_keeps_serving(
    gateway: GatewayProcess, demo_dir: Path, tmp_path: Path, served: list[str]
) -> None:
    # A version of its own: the store is content-addressed, so tampering with the demo pong's
    # files would corrupt the live `pong` adapter too (the engine re-reads them from the store
    # whenever its adapter cache evicts and reloads it).
    own = fx.with_unique_config(demo_dir / "adapters" / "pong", tmp_path / "pong-for-tamper")
    assert put(gateway, "tamper", own).status_code == 200
    served.append("tamper")
    assert put(gateway, "tamper", demo_dir / "adapters" / "fox").status_code == 200
    info = {a["name"]: a for a in gateway.admin("GET", "/admin/adapters").json()["data"]}["tamper"]
    stored = (
        gateway.cache_dir
        / "adapters"
        / "versions"
        / info["previous_version"]
        / "adapter_model.safetensors"
    )
    data = bytearray(stored.read_bytes())
    data[-1] ^= 0xFF
    stored.chmod(0o644)  # stored read-only: this is deliberate
    stored.write_bytes(bytes(data))
    response = gateway.admin("POST", "/admin/adapters/tamper/rollback")
    assert response.status_code == 409
    assert "sha256" in response.json()["error"]["message"]
    assert phrase_of(answer(gateway, "tamper")) == "fox"
