from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from loragate.base_model.vi_runs import ViRunError, download_vi_run, vi_run_layout
from tests.adapter_fixtures import make_vi_run, peft_config, write_shaped_adapter


@pytest.fixture
def peft_dir(tmp_path: Path) -> Path:
    shapes = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (8, 16),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": (16, 8),
    }
    return write_shaped_adapter(tmp_path / "peft", shapes, peft_config())


def test_layout_of_a_run_with_an_adapter(peft_dir: Path, tmp_path: Path) -> None:
    run = make_vi_run(peft_dir, tmp_path / "run_abc", base_model="Qwen/Qwen2.5-VL-3B")
    full, adapter, info = vi_run_layout(run)
    assert (full, adapter) == (run / "model_full", run / "model_adapter")
    assert info["flow"]["spec"]["model"]["name"] == "Qwen/Qwen2.5-VL-3B"


def test_layout_of_a_full_fine_tune_has_no_adapter(tmp_path: Path) -> None:
    _full, adapter, _info = vi_run_layout(make_vi_run(None, tmp_path / "run_full"))
    assert adapter is None


def test_directory_without_model_full_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(ViRunError, match="no model_full/"):
        vi_run_layout(tmp_path)


def test_run_without_run_json_is_refused(tmp_path: Path) -> None:
    run = make_vi_run(None, tmp_path / "run")
    (run / "model_full" / "run.json").unlink()
    with pytest.raises(ViRunError, match=r"no model_full/run\.json"):
        vi_run_layout(run)


def test_run_with_broken_run_json_is_refused(tmp_path: Path) -> None:
    run = make_vi_run(None, tmp_path / "run")
    (run / "model_full" / "run.json").write_text("{")
    with pytest.raises(ViRunError, match="not valid JSON"):
        vi_run_layout(run)


def test_download_without_the_sdk_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "vi", None)
    with pytest.raises(ViRunError, match=r"pip install 'loragate\[vi\]'"):
        download_vi_run("run_abc", "key", "org", tmp_path)


def _fake_vi(
    monkeypatch: pytest.MonkeyPatch, peft_dir: Path | None, calls: list[dict[str, Any]]
) -> None:
    """A stand-in for the vi-sdk package with the API loragate uses (vi.Client.get_model)."""

    class Client:
        def __init__(self, secret_key: str, organization_id: str) -> None:
            calls.append({"secret_key": secret_key, "organization_id": organization_id})

        def get_model(
            self, run_id: str, ckpt: str | None, save_path: Path, show_progress: bool
        ) -> Any:
            calls.append(
                {
                    "run_id": run_id,
                    "ckpt": ckpt,
                    "save_path": save_path,
                    "show_progress": show_progress,
                }
            )
            if run_id == "missing":
                raise RuntimeError("ViNotFoundError: run not found")
            run = make_vi_run(peft_dir, Path(save_path) / run_id)
            return types.SimpleNamespace(
                model_path=str(run / "model_full"), adapter_path=str(run / "model_adapter")
            )

    monkeypatch.setitem(sys.modules, "vi", types.SimpleNamespace(Client=Client))


def test_download_without_credentials_names_the_env_vars(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_vi(monkeypatch, None, [])
    monkeypatch.delenv("DATATURE_VI_SECRET_KEY", raising=False)
    monkeypatch.delenv("DATATURE_VI_ORGANIZATION_ID", raising=False)
    with pytest.raises(ViRunError, match="DATATURE_VI_SECRET_KEY and DATATURE_VI_ORGANIZATION_ID"):
        download_vi_run("run_abc", None, None, tmp_path)


def test_download_uses_env_credentials_and_returns_the_run_dir(
    monkeypatch: pytest.MonkeyPatch, peft_dir: Path, tmp_path: Path
) -> None:
    calls: list[dict[str, Any]] = []
    _fake_vi(monkeypatch, peft_dir, calls)
    monkeypatch.setenv("DATATURE_VI_SECRET_KEY", "env-key")
    monkeypatch.setenv("DATATURE_VI_ORGANIZATION_ID", "env-org")
    run = download_vi_run("run_abc", None, None, tmp_path / "runs", progress=False)
    assert run == tmp_path / "runs" / "run_abc"
    assert calls[0] == {"secret_key": "env-key", "organization_id": "env-org"}
    assert calls[1]["save_path"] == tmp_path / "runs" and calls[1]["show_progress"] is False
    assert vi_run_layout(run)[1] == run / "model_adapter"


def test_download_failure_in_the_sdk_is_reported(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_vi(monkeypatch, None, [])
    with pytest.raises(ViRunError, match=r"could not download run 'missing'.*run not found"):
        download_vi_run("missing", "key", "org", tmp_path)


def test_real_sdk_get_model_takes_the_arguments_loragate_passes() -> None:
    import inspect

    vi = pytest.importorskip("vi")
    parameters = inspect.signature(vi.Client.get_model).parameters
    assert {"run_id", "ckpt", "save_path", "show_progress"} <= set(parameters)
    client_parameters = inspect.signature(vi.Client.__init__).parameters
    assert {"secret_key", "organization_id"} <= set(client_parameters)
