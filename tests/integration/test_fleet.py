"""Two gateways on one adapters manifest served over local HTTP: both converge on each change
within a follow interval, with no failed request under load on either, and both refuse a
broken version while the previous one keeps serving.

Two real engines (the tiny demo model, so both fit on this box), booted side by side.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import phrase_of
from tests.gateway_process import GatewayProcess

pytestmark = [pytest.mark.engine, pytest.mark.restarts, pytest.mark.timeout(1800)]

INTERVAL = 2.0  # LORAGATE_FOLLOW_INTERVAL of both gateways
NAME = "support"
BASE = "loragate-demo"


class ManifestServer:
    """A directory served over HTTP on loopback; the manifest is one file in it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        handler = functools.partial(_QuietHandler, directory=str(root))
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self.url = f"http://127.0.0.1:{self._server.server_port}/adapters.json"

    def write(self, adapters: dict[str, Any]) -> str:
        """Replace the manifest (atomically, as an operator's deploy would); its revision."""
        data = json.dumps({"adapters": adapters}, indent=2).encode()
        part = self.root / "adapters.json.part"
        part.write_bytes(data)
        part.replace(self.root / "adapters.json")
        return hashlib.sha256(data).hexdigest()

    def __enter__(self) -> ManifestServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


def ask(url: str, model: str, index: int) -> tuple[int, str]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"question {index}"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    try:
        # Generous: on a box busy with other engines a request can wait long; a hang still fails.
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    except httpx.HTTPError as exc:
        return 0, repr(exc)
    if response.status_code != 200:
        return response.status_code, response.text
    return 200, response.json()["choices"][0]["message"]["content"]


class Load:
    """Requests for the managed adapter and the base model, on every gateway, until stopped."""

    def __init__(self, urls: list[str], per_gateway: int = 2) -> None:
        self.failures: list[str] = []
        self.answers: Counter[tuple[str, str]] = Counter()
        self.latencies: list[tuple[str, str, float, float]] = []  # url, model, sent, seconds
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(url, i), daemon=True)
            for url in urls
            for i in range(per_gateway)
        ]

    def _run(self, url: str, seed: int) -> None:
        index = seed * 1000
        while not self._stop.is_set():
            index += 1
            model = NAME if index % 2 else BASE
            sent = time.monotonic()
            status, text = ask(url, model, index)
            self.latencies.append((url, model, sent, time.monotonic() - sent))
            if status != 200:
                self.failures.append(f"{url} {model}: {status} {text[:200]}")
            elif model == NAME:
                self.answers[(url, phrase_of(text) or "none")] += 1

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(330)


def manifest_report(gateway: GatewayProcess) -> dict[str, Any]:
    """The admin API's account of the manifest, checked against /health's keyless summary
    (revisions, convergence and the manifest's own error: no sources or per-adapter errors
    without the admin key)."""
    _, body = gateway.health()
    summary = body["adapters_manifest"]
    assert set(summary) == {"serving_revision", "latest_revision", "converged", "error"}, summary
    report: dict[str, Any] = gateway.admin("GET", "/admin/adapters").json()["adapters_manifest"]
    return report


def wait_report(
    gateways: list[GatewayProcess], revision: str, timeout: float, key: str = "serving_revision"
) -> float:
    """Seconds until every gateway reports ``key`` == ``revision``."""
    started = time.monotonic()
    pending = list(gateways)
    while pending:
        pending = [g for g in pending if manifest_report(g)[key] != revision]
        if pending and time.monotonic() - started > timeout:
            reports = [manifest_report(g) for g in pending]
            raise AssertionError(f"{key} is not {revision[:12]} after {timeout} s: {reports}")
        time.sleep(0.05)
    return time.monotonic() - started


def own_cores(index: int) -> dict[str, str]:
    """Each replica's engine on its own core, as docs/scaling.md tells users on a CPU box:
    vLLM's automatic binding pins every engine's worker to the same core, and a busy engine
    then starves the other (seen here: 0.2 tokens/s on one replica, hundreds on the other)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[index % len(cpus)])}


@pytest.fixture(scope="module")
def fleet(
    demo_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ManifestServer, list[GatewayProcess], str]]:
    root = tmp_path_factory.mktemp("fleet-manifest")
    with ManifestServer(root) as server:
        first = server.write({NAME: {"source": str(demo_dir / "adapters" / "pong")}})
        gateways = [
            GatewayProcess(
                cache_dir=tmp_path_factory.mktemp(f"fleet-{i}"),
                args=["--adapters-manifest", server.url],
                env={
                    "LORAGATE_FOLLOW_INTERVAL": str(INTERVAL),
                    "LORAGATE_ALLOWED_SOURCE_NETWORKS": "127.0.0.0/8",  # the manifest's server
                    **own_cores(i),
                },
            ).start()
            for i in range(2)
        ]
        try:
            for gateway in gateways:
                gateway.wait_ready(timeout=900)
            yield server, gateways, first
        finally:
            for gateway in gateways:
                gateway.stop()


def test_both_replicas_serve_the_manifest_and_only_it(
    fleet: tuple[ManifestServer, list[GatewayProcess], str],
) -> None:
    _, gateways, first = fleet
    for gateway in gateways:
        report = manifest_report(gateway)
        assert report["serving_revision"] == first and report["converged"], report
        assert gateway.health()[1]["adapters_manifest"] == {
            "serving_revision": first,
            "latest_revision": first,
            "converged": True,
            "error": None,
        }
        models = httpx.get(f"{gateway.url}/v1/models", timeout=10).json()["data"]
        assert sorted(m["id"] for m in models) == [BASE, NAME]  # no demo adapters beside it
        assert phrase_of(ask(gateway.url, NAME, 1)[1]) == "pong"


def test_the_admin_api_cannot_diverge_from_the_manifest(
    fleet: tuple[ManifestServer, list[GatewayProcess], str], demo_dir: Path
) -> None:
    _, gateways, _ = fleet
    gateway = gateways[0]
    fox = str(demo_dir / "adapters" / "fox")
    attempts = [
        gateway.admin("PUT", f"/admin/adapters/{NAME}", json={"source": fox}),
        gateway.admin("PUT", "/admin/adapters/extra", json={"source": fox}),
        gateway.admin("DELETE", f"/admin/adapters/{NAME}"),
        gateway.admin("POST", f"/admin/adapters/{NAME}/rollback"),
        gateway.admin("POST", "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": fox}),
    ]
    for response in attempts:
        assert response.status_code == 409, response.text
        assert response.json()["error"]["code"] == "managed_by_manifest"
        assert "change the manifest" in response.json()["error"]["message"]
    assert phrase_of(ask(gateway.url, NAME, 2)[1]) == "pong"


def test_a_new_version_reaches_both_under_load_and_a_broken_one_neither(
    fleet: tuple[ManifestServer, list[GatewayProcess], str], demo_dir: Path, tmp_path: Path
) -> None:
    server, gateways, first = fleet
    broken = tmp_path / "broken"
    shutil.copytree(demo_dir / "adapters" / "owl", broken)
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated

    with Load([g.url for g in gateways]) as load:
        time.sleep(2 * INTERVAL)  # answers from the first version on record
        second = server.write({NAME: {"source": str(demo_dir / "adapters" / "fox")}})
        seen = wait_report(gateways, second, INTERVAL + 300, key="latest_revision")
        took = seen + wait_report(gateways, second, timeout=INTERVAL + 300)
        for gateway in gateways:
            assert phrase_of(ask(gateway.url, NAME, 3)[1]) == "fox"
        time.sleep(2 * INTERVAL)  # answers from the second version on record

        third = server.write({NAME: {"source": str(broken)}})
        deadline = time.monotonic() + INTERVAL + 300
        reports: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            reports = [manifest_report(g) for g in gateways]
            if all(NAME in r["adapter_errors"] for r in reports):
                break
            time.sleep(0.2)
        time.sleep(2 * INTERVAL)  # the broken version is not retried, and fox keeps serving
    for gateway in gateways:
        took_each = [s for url, _, _, s in load.latencies if url == gateway.url]
        print(
            f"{gateway.url}: {len(took_each)} requests under load, slowest {max(took_each):.1f} s"
        )
    print(
        f"\nboth replicas fetched the new manifest {seen:.1f} s after it was written and served "
        f"it after {took:.1f} s (follow interval {INTERVAL} s)"
    )

    for report in reports:
        assert report["latest_revision"] == third and report["serving_revision"] == second
        assert not report["converged"]
        assert "truncated" in report["adapter_errors"][NAME], report
    for gateway in gateways:
        code, body = gateway.health()
        assert code == 200, body  # still ready: the previous version serves
        assert phrase_of(ask(gateway.url, NAME, 4)[1]) == "fox"
    assert load.failures == [], load.failures[:5]
    for gateway in gateways:
        phrases = {phrase for (url, phrase), _ in load.answers.items() if url == gateway.url}
        assert phrases == {"pong", "fox"}, load.answers  # before and after, nothing else
    # Within one interval both have the change (slack for a busy box: a pass itself takes a
    # moment); the swap then takes what a PUT takes.
    assert seen <= INTERVAL + 15, f"the fleet took {seen:.1f} s to see the new manifest"
    assert took <= seen + 300, f"the fleet took {took:.1f} s to serve the new manifest"

    # Back to a good manifest (the first): both roll back and converge again.
    again = server.write({NAME: {"source": str(demo_dir / "adapters" / "pong")}})
    assert again == first
    wait_report(gateways, first, timeout=INTERVAL + 300)
    for gateway in gateways:
        assert manifest_report(gateway)["converged"]
        assert phrase_of(ask(gateway.url, NAME, 5)[1]) == "pong"
