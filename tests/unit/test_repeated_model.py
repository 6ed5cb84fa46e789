"""`gateway serve --model A --model B`: the simple case of a catalog, without a config file.

Each model is served under the id one ``--model`` would serve it as (its served name, up to
its last '/'), booted on its first request; what names one model's id or adapters (--lora,
--model-name, a manifest) is refused in one line, since it could not say which model it is
for; one ``--model`` is exactly today's single model. The real command as a subprocess
supervising the stand-in engine (``tools.bench.fake_engine``) for each model; the refusals
through the real CLI in-process, as tests/unit/test_settings_sources.py does.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from loragate import cli
from loragate.demo.layout import demo_base_dir
from loragate.settings import SettingsError, load_settings
from tests.gateway_process import ADMIN_KEY, GatewayProcess

STAND_IN = f"{sys.executable} -m tools.bench.fake_engine"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No setting from the machine running the tests."""
    import os

    for name in list(os.environ):
        if name.upper().startswith("LORAGATE_"):
            monkeypatch.delenv(name)


def two_bases(tmp_path: Path, demo_dir: Path) -> tuple[Path, Path]:
    """The tiny demo model in two folders, ``alpha`` and ``beta`` (copies: a local directory
    is served under its resolved folder's name, so links would share one)."""
    folders = (tmp_path / "bases" / "alpha", tmp_path / "bases" / "beta")
    for folder in folders:
        shutil.copytree(demo_base_dir(demo_dir), folder)
    return folders


def chat(url: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120, trust_env=False)


def test_two_model_options_serve_a_catalog_of_both_through_the_real_command(
    tmp_path: Path, demo_dir: Path
) -> None:
    alpha, beta = two_bases(tmp_path, demo_dir)
    gateway = GatewayProcess(
        cache_dir=tmp_path / "cache",
        args=["--model", str(alpha), "--model", str(beta)],
        env={"LORAGATE_ENGINE_COMMAND": STAND_IN, "LORAGATE_MAX_LOADED_MODELS": "1"},
    ).start()
    try:
        gateway.wait_ready(timeout=120)
        listed = httpx.get(f"{gateway.url}/v1/models", timeout=10, trust_env=False).json()
        assert {entry["id"]: entry["residency"] for entry in listed["data"]} == {
            "alpha": "cold",
            "beta": "cold",
        }
        for model in ("beta", "alpha"):
            answer = chat(gateway.url, model)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == model
        catalog = httpx.get(
            f"{gateway.url}/admin/models",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=10,
            trust_env=False,
        ).json()
        by_id = {model["id"]: model for model in catalog["models"]}
        assert by_id["alpha"]["model"] == str(alpha) and by_id["beta"]["model"] == str(beta)
        assert by_id["alpha"]["residency"] == "resident"
        assert by_id["beta"]["residency"] == "cold"  # unloaded for alpha: at most one loaded
        assert catalog["swaps"] == 1
        assert (tmp_path / "cache" / "models" / "alpha").is_dir()
    finally:
        gateway.stop()


def serve(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *args: str) -> tuple[Any, Any]:
    """`gateway serve` for real up to its server (which receives the app instead); the
    settings it built the app from."""
    import loragate.gateway.app as gateway_app

    seen: dict[str, Any] = {}
    real_create_app = gateway_app.create_app

    def create_app(settings: Any, *more: Any, **options: Any) -> Any:
        seen["settings"] = settings
        return real_create_app(settings, *more, **options)

    monkeypatch.setattr(gateway_app, "create_app", create_app)
    monkeypatch.setattr(
        "loragate.gateway.server.serve.serve_app", lambda app, settings: seen.setdefault("app", app)
    )
    monkeypatch.setattr("gc.freeze", lambda: None)
    result = CliRunner().invoke(
        cli.app, ["serve", "--port", "0", "--cache-dir", str(tmp_path / "cache"), *args]
    )
    return result, seen.get("settings")


def test_one_model_option_is_the_single_model_of_today(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    result, settings = serve(
        monkeypatch, tmp_path, "--model", "org/m", "--upstream-url", "http://127.0.0.1:9/v1"
    )
    assert result.exit_code == 0, result.output
    assert settings.model == "org/m" and settings.models == {}


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--lora", "support=/srv/support"], "--lora"),
        (["--model-name", "qwen"], "--model-name"),
        (["--adapters-manifest", "/srv/manifest.json"], "--adapters-manifest"),
    ],
)
def test_what_names_one_models_adapters_or_id_is_refused_in_one_line_with_several(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, extra: list[str], named: str
) -> None:
    result, settings = serve(monkeypatch, tmp_path, "--model", "org/a", "--model", "org/b", *extra)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [
        f"error: --model is given 2 times (a catalog of base models), and {named} would not "
        "say which model it is for: give each model its id and adapters under models: in a "
        "config file (docs/catalog.md)"
    ]
    assert settings is None  # nothing was built


def test_several_models_and_an_upstream_are_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    args = ["--model", "org/a", "--model", "org/b", "--upstream-url", "http://127.0.0.1:9/v1"]
    result, settings = serve(monkeypatch, tmp_path, *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        "error: --model is given 2 times (a catalog of base models) and --upstream-url also "
        "says what to serve: give one"
    )
    assert settings is None


def test_each_id_is_the_served_name_up_to_its_last_slash(tmp_path: Path) -> None:
    (tmp_path / "support-base").mkdir()
    gguf = tmp_path / "tiny.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    settings = load_settings(
        cache_dir=tmp_path,
        model=["Qwen/Qwen2.5-0.5B-Instruct", str(tmp_path / "support-base"), str(gguf)],
    )
    assert settings.model is None
    assert {model_id: entry.model for model_id, entry in settings.models.items()} == {
        "Qwen2.5-0.5B-Instruct": "Qwen/Qwen2.5-0.5B-Instruct",
        "support-base": str(tmp_path / "support-base"),
        "tiny.Q4_1": str(gguf),
    }


def test_two_models_served_under_one_id_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as raised:
        load_settings(cache_dir=tmp_path, model=["org-a/base", "org-b/base"])
    assert raised.value.problems == [
        "--model org-a/base and --model org-b/base would both be served as 'base': give them "
        "ids under models: in a config file (docs/catalog.md)"
    ]


def test_loragate_model_names_one_model_even_with_a_comma(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LORAGATE_MODEL", "/srv/models/a,b")
    settings = load_settings(cache_dir=tmp_path)
    assert settings.model == "/srv/models/a,b" and settings.models == {}
