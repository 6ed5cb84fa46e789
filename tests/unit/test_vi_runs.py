from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from loragate.adapters.errors import AdapterError
from loragate.adapters.intake.pipeline import sidecar_preset, vi_run_preset_of
from loragate.adapters.preset import Preset
from loragate.base_model.vi_runs import (
    VI_SDK_MODELS_DIR,
    ViRunError,
    checked_checkpoint,
    download_vi_run,
    sdk_cached_run,
    served_vi_run,
    vi_run_layout,
    vi_run_preset,
    vi_task_type,
)
from loragate.base_model.vi_tasks import VI_TASKS
from loragate.gateway.requests.presets import parameter_rules
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


# -- run.json as the Vi SDK reads it (vi-sdk 0.1.0b7) ------------------------------------------


def flow_run_json(
    task: str | None,
    *,
    system_prompt: str | None = None,
    evaluation: dict[str, Any] | None = None,
) -> dict[str, Any]:
    # A real run's model block always has an evaluation section (the SDK's loader needs it).
    """A ``run.json`` in the shape the SDK's loaders decode: ``spec.flow`` is a ``FlowSpec``
    (``vi/api/resources/training_projects/flows/responses.py``) whose blocks are found by the
    substring of their type (``vi/inference/loaders/base_loader.py``)."""
    blocks: list[dict[str, Any]] = []
    if task is not None:
        blocks.append({"block": "dataset-v1", "settings": {"projectKind": task}, "style": {}})
    if system_prompt is not None:
        blocks.append(
            {"block": "system-prompt-v1", "settings": {"systemPrompt": system_prompt}, "style": {}}
        )
    model: dict[str, Any] = {
        "architecture": {"name": "Qwen2.5-VL", "size": "3B"},
        "quantization": {"enabled": False},
        "compute": {"precisionType": "bfloat16"},
    }
    model["evaluation"] = evaluation or {}
    blocks.append({"block": "model-v1", "settings": model, "style": {}})
    flow = {"name": "flow", "schema": "v1", "tolerations": {}, "settings": {}, "blocks": blocks}
    return {"spec": {"flow": flow}}


def write_run(run: Path, info: dict[str, Any], adapter: Path | None) -> Path:
    full = run / "model_full"
    full.mkdir(parents=True)
    (full / "run.json").write_text(json.dumps(info))
    (full / "config.json").write_text("{}")
    (full / "model.safetensors").write_bytes(b"weights")
    if adapter is not None:
        shutil.copytree(adapter, run / "model_adapter")
    return run


class _ModelMeta:
    """What the SDK's loaders read run.json through (``ModelDownloadResult.run_config_path``)."""

    def __init__(self, path: Path) -> None:
        self.run_config_path = str(path)


def sdk_reading(run_json: Path) -> tuple[dict[str, Any], Any]:
    """(metadata, generation config) as the installed Vi SDK's own loader reads ``run_json``."""
    pytest.importorskip("vi.inference.loaders.base_loader")
    from vi.inference.loaders.base_loader import BaseLoader

    loader = BaseLoader.__new__(BaseLoader)
    BaseLoader.__init__(loader)
    loader._load_metadata_from_run_json(_ModelMeta(run_json))  # type: ignore[arg-type]
    loader._load_generation_config_from_run_json(_ModelMeta(run_json))  # type: ignore[arg-type]
    return loader.metadata, loader.generation_config


TASKS = ["phrase-grounding", "vqa", "freeform", "video-freeform", "generic"]


def test_the_task_table_is_the_installed_sdks() -> None:
    """vi_tasks.py copies vi/inference/task_types/consts.py: every task type, its default system
    and user prompts, and its Pydantic schema (descriptions aside) match the SDK's own."""
    consts = pytest.importorskip("vi.inference.task_types.consts")

    def without_descriptions(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: without_descriptions(v) for k, v in value.items() if k != "description"}
        if isinstance(value, list):
            return [without_descriptions(v) for v in value]
        return value

    assert sorted(VI_TASKS) == sorted(t.value for t in consts.TaskType)
    for task_type in consts.TaskType:
        task = VI_TASKS[task_type.value]
        assert task.system_prompt == consts.TASK_TYPE_TO_SYSTEM_PROMPT_MAP[task_type]
        assert task.user_prompt == consts.TASK_TYPE_TO_USER_PROMPT_MAP[task_type]
        model = consts.TASK_TYPE_TO_ASSISTANT_MAP[task_type]
        if model is None:
            assert task.schema is None
        else:
            assert task.schema_name == model.__name__
            assert task.schema == without_descriptions(model.model_json_schema())


@pytest.mark.parametrize("task", TASKS)
def test_a_runs_preset_is_what_the_sdks_loader_reads_from_run_json(
    task: str, tmp_path: Path
) -> None:
    """base_loader.py _load_metadata_from_run_json: the task type is the dataset block's
    projectKind, the system prompt the system-prompt block's, else the task's default."""
    path = tmp_path / "run.json"
    path.write_text(json.dumps(flow_run_json(task)))
    metadata, _config = sdk_reading(path)
    preset = vi_run_preset(flow_run_json(task))
    assert vi_task_type(flow_run_json(task)) == metadata["task_type"] == task
    assert preset.get("system_prompt", "") == metadata["system_prompt"]
    own = flow_run_json(task, system_prompt="You inspect solder joints.")
    path.write_text(json.dumps(own))
    assert vi_run_preset(own)["system_prompt"] == sdk_reading(path)[0]["system_prompt"]
    assert vi_run_preset(own)["system_prompt"] == "You inspect solder joints."


@pytest.mark.parametrize("task", TASKS)
def test_a_runs_user_prompt_and_schema_are_its_tasks(task: str) -> None:
    """predictors/hf.py: a request without a user prompt gets TASK_TYPE_TO_USER_PROMPT_MAP's,
    and the answer is constrained to TASK_TYPE_TO_ASSISTANT_MAP's schema (generic: neither)."""
    preset = vi_run_preset(flow_run_json(task))
    if task == "generic":
        assert "user_prompt" not in preset and "response_format" not in preset
        return
    assert preset["user_prompt"] == VI_TASKS[task].user_prompt
    response_format = preset["response_format"]
    assert response_format["type"] == "json_schema"
    assert response_format["json_schema"]["schema"] == VI_TASKS[task].schema
    assert Preset.from_dict(preset, parameter_rules)  # the gateway's own check holds


def test_the_generation_config_is_the_evaluation_block_greedy_as_the_sdk_generates(
    tmp_path: Path,
) -> None:
    """_load_generation_config_from_run_json decodes the model block's evaluation into
    ViGenerationConfig (its defaults for what is left out); hf.py _prepare_generation_config
    then sets do_sample = False: greedy, temperature 0 in vLLM's terms."""
    evaluation = {"max_new_tokens": 300, "top_p": 0.9, "stop_strings": ["}}"], "seed": 7}
    info = flow_run_json("vqa", evaluation=evaluation)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(info))
    _metadata, config = sdk_reading(path)
    preset = vi_run_preset(info)
    defaults = preset["defaults"]
    assert defaults["temperature"] == 0.0
    assert defaults["max_tokens"] == config.max_new_tokens == 300
    assert defaults["top_p"] == config.top_p and defaults["top_k"] == config.top_k
    assert defaults["repetition_penalty"] == config.repetition_penalty
    assert defaults["seed"] == config.seed == 7
    assert preset["stop"] == config.stop_strings == ["}}"]
    # What evaluation leaves out: ViGenerationConfig's defaults.
    bare = vi_run_preset(flow_run_json("vqa"))["defaults"]
    vi_config = pytest.importorskip("vi.inference.config.base_config").ViGenerationConfig()
    assert (bare["max_tokens"], bare["top_k"], bare["top_p"], bare["repetition_penalty"]) == (
        vi_config.max_new_tokens,
        vi_config.top_k,
        vi_config.top_p,
        vi_config.repetition_penalty,
    )
    assert "seed" not in vi_run_preset(flow_run_json("vqa", evaluation={"seed": -1}))["defaults"]


def test_a_task_type_the_sdk_does_not_know_is_refused() -> None:
    with pytest.raises(ViRunError, match="'segmentation' is none the Vi SDK knows"):
        vi_run_preset(flow_run_json("segmentation"))


def test_a_run_json_without_a_flow_is_a_generic_run() -> None:
    """The older fixtures' run.json (no spec.flow): no task, so no prompt, schema or user prompt
    (as the SDK's loaders for a model without run.json: task_type generic, system prompt '')."""
    preset = vi_run_preset({"runId": "r", "flow": {"spec": {"task_type": "VQA"}}})
    assert set(preset) == {"defaults"}


def test_the_adapter_of_a_run_carries_its_preset_and_the_run_is_left_as_it_was(
    peft_dir: Path, tmp_path: Path
) -> None:
    run = write_run(tmp_path / "run_pg", flow_run_json("phrase-grounding"), peft_dir)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    base, adapter = served_vi_run(run, tmp_path / "served")
    assert base == run / "model_full" and adapter is not None
    assert sidecar_preset(adapter, "the run", parameter_rules) == Preset.from_dict(
        vi_run_preset(flow_run_json("phrase-grounding")), parameter_rules
    )
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_a_full_fine_tune_gives_the_base_model_its_preset(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run_full", flow_run_json("vqa", system_prompt="Count."), None)
    base, adapter = served_vi_run(run, tmp_path / "served")
    assert adapter is None and base != run / "model_full"
    assert (base / "model.safetensors").read_bytes() == b"weights"  # the run's own files
    preset = sidecar_preset(base, "the base", parameter_rules)
    assert preset is not None and preset.system_prompt == "Count."
    assert not (run / "model_full" / "loragate.json").exists()
    # Prepared again (the next boot): the same, from scratch.
    assert served_vi_run(run, tmp_path / "served") == (base, None)


def test_a_run_in_the_sdks_cache_is_found_only_when_complete(tmp_path: Path) -> None:
    """vi_model.py ViModel.__init__: a cached model_full with all its safetensors is used with
    no download (vi/utils/safetensors.py safetensors_complete, sharded or single-file)."""
    models = tmp_path / "models"
    assert sdk_cached_run("run_x", models) is None
    run = write_run(models / "run_x", flow_run_json("vqa"), None)
    assert sdk_cached_run("run_x", models) == run
    full = run / "model_full"
    (full / "model.safetensors").unlink()
    assert sdk_cached_run("run_x", models) is None
    index = {"weight_map": {"a": "model-00001.safetensors", "b": "model-00002.safetensors"}}
    (full / "model.safetensors.index.json").write_text(json.dumps(index))
    (full / "model-00001.safetensors").write_bytes(b"1")
    assert sdk_cached_run("run_x", models) is None  # a shard missing: the SDK downloads again
    (full / "model-00002.safetensors").write_bytes(b"2")
    assert sdk_cached_run("run_x", models) == run
    pytest.importorskip("vi.utils.safetensors")
    from vi.utils.safetensors import safetensors_complete

    assert safetensors_complete(full)


def test_the_sdks_cache_dir_is_the_sdks() -> None:
    consts = pytest.importorskip("vi.consts")
    assert VI_SDK_MODELS_DIR.expanduser() == consts.DEFAULT_MODEL_DIR


def test_a_checkpoint_must_be_a_plain_name() -> None:
    assert checked_checkpoint("epoch_10") == "epoch_10"
    for bad in ("../x", "a/b", ".hidden", ""):
        with pytest.raises(ViRunError, match="plain name"):
            checked_checkpoint(bad)


# -- which copy of a run is served (engine_plan._vi_run) ---------------------------------------


def _no_download(monkeypatch: pytest.MonkeyPatch) -> None:
    """No vi-sdk and no credentials: any download would fail loudly."""
    monkeypatch.setitem(sys.modules, "vi", None)
    monkeypatch.delenv("DATATURE_VI_SECRET_KEY", raising=False)
    monkeypatch.delenv("DATATURE_VI_ORGANIZATION_ID", raising=False)


def test_a_run_in_the_sdks_cache_is_served_offline_with_its_preset(
    monkeypatch: pytest.MonkeyPatch, peft_dir: Path, tmp_path: Path
) -> None:
    from loragate.plan.engine_plan import _vi_run
    from loragate.settings import Settings

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    _no_download(monkeypatch)
    run = write_run(home / ".datature/vi/models/run_vqa", flow_run_json("vqa"), peft_dir)
    cache = tmp_path / "cache"
    base, adapter = _vi_run(Settings(run_id="run_vqa"), cache)
    assert base == run / "model_full"
    assert adapter is not None and adapter.is_relative_to(cache)
    preset = sidecar_preset(adapter, "run_vqa", parameter_rules)
    assert preset is not None and preset.user_prompt == VI_TASKS["vqa"].user_prompt
    # Not in the SDK's cache (nor loragate's): a download, which needs the SDK here.
    with pytest.raises(ViRunError, match="vi-sdk"):
        _vi_run(Settings(run_id="run_other"), cache)


def test_a_chosen_checkpoint_is_downloaded_as_asked_and_kept_apart(
    monkeypatch: pytest.MonkeyPatch, peft_dir: Path, tmp_path: Path
) -> None:
    """The SDK's cache holds one copy per run whichever checkpoint it was
    (vi_model.py: save_path/run_id, ckpt unused on a cache hit): a chosen checkpoint is not
    taken from it, but downloaded (client.get_model(ckpt=...)) into its own directory."""
    from loragate.plan.engine_plan import _vi_run
    from loragate.settings import Settings

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    write_run(home / ".datature/vi/models/run_abc", flow_run_json("vqa"), peft_dir)
    calls: list[dict[str, Any]] = []
    _fake_vi(monkeypatch, peft_dir, calls)
    cache = tmp_path / "cache"
    settings = Settings(run_id="run_abc", checkpoint="epoch_3", secret_key="k", organization_id="o")
    base, adapter = _vi_run(settings, cache)
    assert calls[1]["ckpt"] == "epoch_3"
    assert base == cache / "vi-runs/checkpoints/epoch_3/run_abc/model_full"
    assert adapter is not None
    calls.clear()
    assert _vi_run(settings, cache) == (base, adapter)  # downloaded once
    assert calls == []
    with pytest.raises(ViRunError, match="plain name"):
        _vi_run(Settings(run_id="run_abc", checkpoint="../x"), cache)


def test_a_full_fine_tune_answers_to_its_run_id_and_to_run_base() -> None:
    """The Vi server names a run's model by its run id (vi_backend.py list_models:
    [self.run_id]); loragate serves the base as RUN-base (the adapter, when there is one, is
    RUN), so RUN is the base's alias: it applies only when no adapter answers to it."""
    from loragate.settings import Settings

    settings = Settings(run_id="run_full")
    assert settings.served_model_name == "run_full-base"
    assert settings.served_model_aliases == {"run_full": "run_full-base"}
    named = Settings(run_id="run_full", model_name="inspector")
    assert named.served_model_aliases == {"run_full": "inspector"}
    assert Settings(run_id="run_full", model_name="run_full").served_model_aliases == {}


def test_a_run_put_as_an_adapter_source_brings_its_run_json_preset(
    peft_dir: Path, tmp_path: Path
) -> None:
    """``PUT /admin/adapters`` of a downloaded run (the pipeline's ``vi_run_preset_of``): the
    preset ``--run-id`` would serve, and an adapter's own ``loragate.json`` wins over it."""
    info = flow_run_json("phrase-grounding", system_prompt="Ground it.")
    run = write_run(tmp_path / "run_put", info, peft_dir)
    expected = Preset.from_dict(vi_run_preset(info), parameter_rules)
    assert vi_run_preset_of(run, "the run", parameter_rules) == expected
    (run / "model_adapter" / "loragate.json").write_text(json.dumps({"preset": {"stop": ["X"]}}))
    own = vi_run_preset_of(run, "the run", parameter_rules)
    assert own is not None and own.stop == ("X",) and own.system_prompt is None


def test_a_run_put_without_run_json_has_no_preset_and_a_bad_one_is_a_clear_error(
    peft_dir: Path, tmp_path: Path
) -> None:
    run = write_run(tmp_path / "run_none", flow_run_json("vqa"), peft_dir)
    (run / "model_full" / "run.json").unlink()
    assert vi_run_preset_of(run, "the run", parameter_rules) is None
    (run / "model_full" / "run.json").write_text(json.dumps(flow_run_json("no-such-task")))
    with pytest.raises(AdapterError, match=r"the run: .*no-such-task") as raised:
        vi_run_preset_of(run, "the run", parameter_rules)
    assert raised.value.code == "invalid_preset"
