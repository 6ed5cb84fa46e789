"""A catalog of base models behind one gateway, each its own supervised engine: residency
within a cap, swaps, ttl, keep, requests in flight never cut, adapters found in an
``adapter_dir``, one model failing alone.

Real gateways (in-process uvicorn) supervising real engine processes: the stand-in engine
(``tools.bench.fake_engine``, which takes vLLM's command line) for each base, on the tiny
demo model's directory. The real engine's two-model run is in tests/integration/test_catalog.py.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from loragate.demo.layout import demo_adapter_dir, demo_base_dir
from loragate.gateway.app import create_app
from loragate.settings import Settings
from tests.backend_double import serving

STAND_IN = [sys.executable, "-m", "tools.bench.fake_engine"]
ADMIN = {"Authorization": "Bearer the-admin"}


def catalog_settings(tmp_path: Path, demo_dir: Path, **values: Any) -> Settings:
    base = str(demo_base_dir(demo_dir))
    models = values.pop("models", None) or {
        "alpha": {"model": base, "lora": [f"pong={demo_adapter_dir(demo_dir, 'pong')}"]},
        "beta": {"model": base, "lora": [f"fox={demo_adapter_dir(demo_dir, 'fox')}"]},
    }
    return Settings(
        cache_dir=tmp_path / "cache",
        models=models,
        engine_command=STAND_IN,
        probe_interval=0.2,
        admin_key="the-admin",
        **values,
    )


def chat(url: str, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def residency(url: str) -> dict[str, str]:
    models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    return {entry["id"]: entry["residency"] for entry in models}


def catalog(url: str) -> dict[str, Any]:
    answer = httpx.get(f"{url}/admin/models", headers=ADMIN, timeout=10)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    return {model["id"]: model for model in body["models"]} | {"_": body}


def wait_for(predicate: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_v1_models_lists_every_base_and_adapter_with_parent_and_residency(
    tmp_path: Path, demo_dir: Path
) -> None:
    with serving(create_app(catalog_settings(tmp_path, demo_dir))) as url:
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200)
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        by_id = {entry["id"]: entry for entry in models}
        assert set(by_id) == {"alpha", "pong", "beta", "fox"}
        assert by_id["pong"]["parent"] == "alpha" and by_id["fox"]["parent"] == "beta"
        assert by_id["alpha"]["parent"] is None
        assert {entry["residency"] for entry in models} == {"cold"}  # nothing booted yet


def test_a_cap_of_one_swaps_engines_and_every_request_is_answered_by_its_base(
    tmp_path: Path, demo_dir: Path
) -> None:
    settings = catalog_settings(tmp_path, demo_dir, max_loaded_models=1)
    with serving(create_app(settings)) as url:
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200)
        for model in ["alpha", "pong", "beta", "fox", "alpha"]:
            answer = chat(url, model)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == model
            owner = "alpha" if model in ("alpha", "pong") else "beta"
            state = residency(url)
            assert state[owner] == "resident"
            assert [m for m, r in state.items() if r == "resident"] in (
                ["alpha", "pong"],
                ["beta", "fox"],
            )
        report = catalog(url)
        assert report["_"]["swaps"] == 2  # alpha, then beta for alpha, then alpha for beta
        assert report["alpha"]["loads"] == 2 and report["beta"]["unloads"] == 1
        assert report["_"]["last_swap"]["unloaded"] == ["beta"]


def test_concurrent_requests_for_two_models_under_a_cap_of_one_all_succeed(
    tmp_path: Path, demo_dir: Path
) -> None:
    settings = catalog_settings(tmp_path, demo_dir, max_loaded_models=1)

    async def burst(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:

            async def one(model: str) -> httpx.Response:
                body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
                return await client.post(f"{url}/v1/chat/completions", json=body)

            return await asyncio.gather(*(one(m) for m in ["pong", "fox"] * 6))

    with serving(create_app(settings)) as url:
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200)
        answers = asyncio.run(burst(url))
        assert [a.status_code for a in answers] == [200] * 12, [a.text for a in answers]
        assert [a.json()["model"] for a in answers] == ["pong", "fox"] * 6
        assert catalog(url)["_"]["swaps"] >= 1


def test_with_room_for_both_both_stay_resident_and_nothing_swaps(
    tmp_path: Path, demo_dir: Path
) -> None:
    with serving(create_app(catalog_settings(tmp_path, demo_dir, max_loaded_models=2))) as url:
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200)
        for model in ["pong", "fox", "alpha", "beta"]:
            assert chat(url, model).status_code == 200
        assert set(residency(url).values()) == {"resident"}
        assert catalog(url)["_"]["swaps"] == 0


def test_a_request_in_flight_is_never_cut_by_an_eviction(tmp_path: Path, demo_dir: Path) -> None:
    base = str(demo_base_dir(demo_dir))
    models = {
        # alpha generates slowly: a token every 0.1 s, 30 tokens.
        "alpha": {"model": base, "engine_args": ["--token-interval", "0.1"]},
        "beta": {"model": base},
    }
    settings = catalog_settings(tmp_path, demo_dir, models=models, max_loaded_models=1)

    async def overlap(url: str) -> tuple[httpx.Response, httpx.Response, float, float]:
        async with httpx.AsyncClient(timeout=120) as client:
            await client.post(  # alpha resident first
                f"{url}/v1/chat/completions",
                json={"model": "alpha", "messages": [{"role": "user", "content": "x"}]},
            )

            async def timed() -> tuple[httpx.Response, float]:
                answer = await client.post(
                    f"{url}/v1/chat/completions",
                    json={
                        "model": "alpha",
                        "max_tokens": 30,
                        "messages": [{"role": "user", "content": "x"}],
                    },
                )
                return answer, time.monotonic()

            slow = asyncio.create_task(timed())
            await asyncio.sleep(0.5)  # alpha's answer is on its way
            other = await client.post(
                f"{url}/v1/chat/completions",
                json={"model": "beta", "messages": [{"role": "user", "content": "x"}]},
            )
            other_done = time.monotonic()
            first, first_done = await slow
            return first, other, first_done, other_done

    with serving(create_app(settings)) as url:
        first, other, first_done, other_done = asyncio.run(overlap(url))
        assert first.status_code == 200 and other.status_code == 200, (first.text, other.text)
        assert first.json()["usage"]["completion_tokens"] == 30  # answered whole
        assert first_done <= other_done  # beta waited for alpha's request to finish
        assert residency(url)["beta"] == "resident" and residency(url)["alpha"] == "cold"


def test_ttl_unloads_an_idle_model_and_the_next_request_loads_it_again(
    tmp_path: Path, demo_dir: Path
) -> None:
    base = str(demo_base_dir(demo_dir))
    settings = catalog_settings(
        tmp_path, demo_dir, models={"alpha": {"model": base, "ttl": 1}, "beta": {"model": base}}
    )
    with serving(create_app(settings)) as url:
        assert chat(url, "alpha").status_code == 200 and chat(url, "beta").status_code == 200
        wait_for(lambda: residency(url)["alpha"] == "cold", timeout=20)
        assert residency(url)["beta"] == "resident"  # no ttl: stays
        assert "ttl" in catalog(url)["alpha"]["last_unload_reason"]
        assert chat(url, "alpha").status_code == 200
        assert catalog(url)["alpha"]["loads"] == 2


def test_keep_is_never_evicted_a_request_for_another_is_a_503_with_retry_after(
    tmp_path: Path, demo_dir: Path
) -> None:
    base = str(demo_base_dir(demo_dir))
    settings = catalog_settings(
        tmp_path,
        demo_dir,
        models={"alpha": {"model": base, "keep": True, "preload": True}, "beta": {"model": base}},
        max_loaded_models=1,
        drain_timeout=1,
    )
    with serving(create_app(settings)) as url:
        wait_for(lambda: residency(url)["alpha"] == "resident")  # preload
        refused = chat(url, "beta")
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert refused.json()["error"]["code"] == "model_capacity"
        assert "alpha" in refused.json()["error"]["message"]
        assert residency(url) == {"alpha": "resident", "beta": "cold"}


def test_an_adapter_folder_in_adapter_dir_answers_its_first_request_nothing_else_is_fetched(
    tmp_path: Path, demo_dir: Path
) -> None:
    folder = tmp_path / "adapters"
    shutil.copytree(demo_adapter_dir(demo_dir, "owl"), folder / "night-owl")
    base = str(demo_base_dir(demo_dir))
    settings = catalog_settings(
        tmp_path, demo_dir, models={"alpha": {"model": base, "adapter_dir": str(folder)}}
    )
    with serving(create_app(settings)) as url:
        assert "night-owl" not in residency(url)
        answer = chat(url, "night-owl")
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "night-owl"
        assert residency(url)["night-owl"] == "resident"
        missing = chat(url, "hf-org-model")
        assert missing.status_code == 404
        assert "night-owl" in missing.json()["error"]["message"]  # names the valid ids
        traversal = chat(url, "../adapters")
        assert traversal.status_code == 404
        stored = list((tmp_path / "cache" / "models" / "alpha").rglob("adapter_config.json"))
        assert len(stored) == 1  # the one found adapter, and nothing else, was stored


def test_a_model_that_cannot_boot_fails_alone_with_its_reason(
    tmp_path: Path, demo_dir: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    base = str(demo_base_dir(demo_dir))
    settings = catalog_settings(
        tmp_path, demo_dir, models={"alpha": {"model": base}, "bad": {"model": str(broken)}}
    )
    with serving(create_app(settings)) as url:
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).json().get("status") != "starting")
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 200
        assert health.json()["status"] == "degraded"
        assert health.json()["catalog"]["bad"]["residency"] == "failed"
        assert "config.json" in health.json()["catalog"]["bad"]["reason"]
        assert chat(url, "alpha").status_code == 200
        failed = chat(url, "bad")
        assert failed.status_code == 503 and "config.json" in failed.json()["error"]["message"]


def test_models_load_and_unload_by_hand(tmp_path: Path, demo_dir: Path) -> None:
    with serving(create_app(catalog_settings(tmp_path, demo_dir))) as url:
        loaded = httpx.post(f"{url}/admin/models/beta/load", headers=ADMIN, timeout=60)
        assert loaded.status_code == 200, loaded.text
        wait_for(lambda: residency(url)["beta"] == "resident")
        unloaded = httpx.post(f"{url}/admin/models/beta/unload", headers=ADMIN, timeout=60)
        assert unloaded.json()["residency"] == "cold"
        unknown = httpx.post(f"{url}/admin/models/nope/load", headers=ADMIN, timeout=10)
        assert unknown.status_code == 404


@pytest.mark.parametrize(
    "values",
    [
        {"model": "/m"},
        {"lora": ["a=/b"]},
        {"upstream_url": "http://127.0.0.1:9/v1"},
    ],
)
def test_a_catalog_and_a_single_model_are_refused_together(values: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="both say what to serve"):
        Settings(models={"alpha": {"model": "/m/a"}}, **values)


def test_catalog_ids_are_names() -> None:
    with pytest.raises(ValueError, match="model ids must be"):
        Settings(models={"a/b": {"model": "/m/a"}})


def test_gateway_models_list_load_unload(tmp_path: Path, demo_dir: Path) -> None:
    """The real `gateway models` commands against a running catalog."""
    import subprocess

    def gateway(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "loragate.cli", "models", *args]
        command += ["--url", url, "--admin-key", "the-admin"]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    with serving(create_app(catalog_settings(tmp_path, demo_dir))) as url:
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200)
        listed = gateway("list")
        assert listed.returncode == 0, listed.stderr
        rows = {line.split()[0]: line.split()[1] for line in listed.stdout.splitlines()[1:-1]}
        assert rows == {"alpha": "cold", "beta": "cold"}
        assert "pong" in listed.stdout and listed.stdout.rstrip().endswith("swaps: 0")
        loaded = gateway("load", "beta")
        assert loaded.returncode == 0 and loaded.stdout.startswith("beta: "), loaded.stderr
        wait_for(lambda: residency(url)["beta"] == "resident")
        unloaded = gateway("unload", "beta")
        assert unloaded.stdout.strip() == "beta: cold (stopped)"
        missing = gateway("load", "gamma")
        assert missing.returncode != 0 and "gamma" in missing.stderr


def test_sleep_mode_unloads_by_sleeping_and_loads_by_waking_the_same_engine(
    tmp_path: Path, demo_dir: Path
) -> None:
    """With ``sleep: true`` an eviction is vLLM's /sleep (the engine process stays) and the next
    request is a /wake_up, not a boot. The stand-in engine serves the sleep routes as vLLM does
    (only with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1) and, as vLLM, holds a generation
    that comes while asleep until the wake, saying so in its log: none was held, so the wake
    came first."""
    base = str(demo_base_dir(demo_dir))
    models = {"alpha": {"model": base, "sleep": True}, "beta": {"model": base, "sleep": True}}
    settings = catalog_settings(tmp_path, demo_dir, models=models, max_loaded_models=1)
    app = create_app(settings)
    with serving(app) as url:
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200)
        assert chat(url, "alpha").status_code == 200
        engines = httpx.get(f"{url}/admin/engine", headers=ADMIN, timeout=10).json()
        alpha_pid = engines["alpha"]["pid"]
        assert chat(url, "beta").status_code == 200
        assert residency(url) == {"alpha": "asleep", "beta": "resident"}
        answer = chat(url, "alpha")
        assert answer.status_code == 200, answer.text
        assert residency(url) == {"alpha": "resident", "beta": "asleep"}
        report = catalog(url)
        assert report["alpha"]["loads"] == 1 and report["alpha"]["wakes"] == 1
        assert report["alpha"]["sleep_mode"] is True
        engines = httpx.get(f"{url}/admin/engine", headers=ADMIN, timeout=10).json()
        assert engines["alpha"]["pid"] == alpha_pid and engines["alpha"]["restarts"] == 0
        argv = Path(f"/proc/{alpha_pid}/cmdline").read_bytes().split(b"\0")
        assert b"--enable-sleep-mode" in argv
        log = tmp_path / "cache" / "models" / "alpha" / "logs" / "engine.log"
        assert "holding a generation" not in log.read_text()
        unloaded = httpx.post(f"{url}/admin/models/beta/unload", headers=ADMIN, timeout=60)
        assert unloaded.json()["residency"] == "cold"  # by hand: stopped, not asleep


def test_a_url_template_resolver_fetches_only_there_and_a_miss_is_not_asked_again(
    tmp_path: Path, demo_dir: Path
) -> None:
    """``resolvers: [URL with {name}]``: an unregistered name is fetched from the template's
    URL (a real local HTTP server holding an archive of a demo adapter), converted, validated,
    stored and served; a name the server lacks is a 404 naming the valid ids, and asking again
    soon sends nothing."""
    import http.server
    import tarfile
    import threading

    archive = tmp_path / "served" / "lynx.tar.gz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(demo_adapter_dir(demo_dir, "fox"), arcname="lynx")
    asked: list[str] = []

    class Adapters(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(archive.parent), **kwargs)

        def log_message(self, *args: Any) -> None:
            asked.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Adapters)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    template = f"http://127.0.0.1:{server.server_address[1]}/{{name}}.tar.gz"
    base = str(demo_base_dir(demo_dir))
    settings = catalog_settings(
        tmp_path,
        demo_dir,
        models={"alpha": {"model": base, "resolvers": [template]}},
        allowed_source_networks=["127.0.0.1/32"],
    )
    try:
        with serving(create_app(settings)) as url:
            wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200)
            answer = chat(url, "lynx")
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == "lynx"
            assert any(path.startswith("/lynx.tar.gz") for path in asked)
            assert residency(url)["lynx"] == "resident"
            missing = chat(url, "no-such-adapter")
            assert missing.status_code == 404
            assert "lynx" in missing.json()["error"]["message"]
            fetched = len(asked)
            again = chat(url, "no-such-adapter")
            assert again.status_code == 404 and len(asked) == fetched  # nothing sent
            assert chat(url, "a/b").status_code == 404 and len(asked) == fetched
    finally:
        server.shutdown()


def test_resolvers_must_be_hub_prefixes_or_url_templates() -> None:
    assert Settings(models={"a": {"model": "/m", "resolvers": ["hf://org/"]}}).models
    for bad in ["hf://org/repo", "https://host/adapters.tar.gz", "file:///x/{name}"]:
        with pytest.raises(ValueError, match="resolver"):
            Settings(models={"a": {"model": "/m", "resolvers": [bad]}})


def test_a_fleet_manifest_carries_adapters_per_base_model(tmp_path: Path, demo_dir: Path) -> None:
    """``{"models": {"ID": {"adapters": ...}}}``: each model serves its part; a model the
    manifest has no part for keeps what it had and says why; the admin API refuses changes."""
    import json

    manifest = tmp_path / "fleet.json"
    parts = {
        "alpha": {"adapters": {"pong": {"source": str(demo_adapter_dir(demo_dir, "pong"))}}},
        "beta": {"adapters": {"fox": {"source": str(demo_adapter_dir(demo_dir, "fox"))}}},
    }
    manifest.write_text(json.dumps({"models": parts}))
    base = str(demo_base_dir(demo_dir))
    models = {"alpha": {"model": base}, "beta": {"model": base}, "gamma": {"model": base}}
    settings = catalog_settings(
        tmp_path, demo_dir, models=models, adapters_manifest=str(manifest), follow_interval=60
    )
    with serving(create_app(settings)) as url:
        wait_for(lambda: {"pong", "fox"} <= set(residency(url)))
        by_id = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
        assert by_id["pong"]["parent"] == "alpha" and by_id["fox"]["parent"] == "beta"
        assert chat(url, "fox").json()["model"] == "fox"
        report = httpx.get(f"{url}/admin/adapters", headers=ADMIN, timeout=10).json()
        fleets = report["adapters_manifest"]
        assert fleets["alpha"]["error"] is None
        assert "no part for base model 'gamma'" in fleets["gamma"]["error"]
        refused = httpx.put(
            f"{url}/admin/adapters/owl",
            headers=ADMIN,
            json={"source": str(demo_adapter_dir(demo_dir, "owl"))},
            timeout=10,
        )
        assert refused.status_code == 409


def test_a_one_model_gateway_refuses_a_per_base_manifest() -> None:
    from loragate.adapters.fleet_manifest import FleetManifestError, parse_fleet_manifest

    data = b'{"models": {"alpha": {"adapters": {"a": {"source": "/x"}}}}}'
    with pytest.raises(FleetManifestError, match="one base model"):
        parse_fleet_manifest(data)
    assert set(parse_fleet_manifest(data, "alpha").adapters) == {"a"}
    with pytest.raises(FleetManifestError, match="no part for base model 'beta'"):
        parse_fleet_manifest(data, "beta")


@pytest.mark.parametrize(
    "flag", [["--port", "9000"], ["--max-loras=4"], ["--enable-lora"], ["--model", "/x"]]
)
def test_a_models_engine_args_may_not_set_what_loragate_sets(flag: list[str]) -> None:
    with pytest.raises(ValueError) as raised:
        Settings(models={"a": {"model": "/m", "engine_args": [*flag, "--max-model-len", "2048"]}})
    message = str(raised.value)
    assert "models.a.engine_args" in message
    assert "a model's engine_args may not set what loragate sets itself" in message
    assert flag[0].split("=")[0] in message
