from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loragate.adapters.intake.convert import (
    ConversionError,
    convert_in_subprocess,
    convert_to_peft,
    detect_format,
    needs_conversion,
)
from loragate.adapters.intake.validate import validate_adapter
from loragate.base_model.resolve import read_base_config
from loragate.demo.layout import demo_adapter_dir, demo_base_dir
from tests.adapter_fixtures import (
    load_tensors,
    make_bin_adapter,
    make_mlx_adapter,
    make_tinker_dir,
    make_tinker_moe_dir,
    make_vi_run,
    read_config,
    save_tensors,
)

PEFT_FILES = ["adapter_config.json", "adapter_model.safetensors"]


@pytest.fixture(scope="module")
def pong(demo_dir: Path) -> Path:
    return demo_adapter_dir(demo_dir, "pong")


@pytest.fixture(scope="module")
def base_config(demo_dir: Path) -> dict[str, Any]:
    return read_base_config(demo_base_dir(demo_dir))


def _assert_same_tensors(got: dict[str, Any], want: dict[str, Any]) -> None:
    import torch

    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype, key
        assert torch.equal(got[key], tensor), key


def _assert_complete_config(config: dict[str, Any]) -> None:
    assert config["peft_type"] == "LORA"
    assert config["bias"] == "none"
    assert config["task_type"] == "CAUSAL_LM"
    assert config["modules_to_save"] is None
    assert config["use_dora"] is False
    for field in ("r", "lora_alpha", "target_modules", "base_model_name_or_path"):
        assert field in config


def test_detect_format_names_each_layout(pong: Path, tmp_path: Path) -> None:
    assert detect_format(pong) == "peft"
    assert detect_format(make_bin_adapter(pong, tmp_path / "bin")) == "peft-bin"
    assert detect_format(make_tinker_dir(pong, tmp_path / "tinker")) == "tinker"
    assert detect_format(make_mlx_adapter(pong, tmp_path / "mlx")) == "mlx"
    assert detect_format(make_vi_run(pong, tmp_path / "run")) == "vi-run"


def test_tinker_export_without_marker_is_still_recognised_by_its_config(
    pong: Path, tmp_path: Path
) -> None:
    tinker = make_tinker_dir(pong, tmp_path / "tinker", unembed=None)
    (tinker / "checkpoint_complete").unlink()
    assert detect_format(tinker) == "tinker"


def test_unknown_directory_is_refused_listing_what_it_holds(tmp_path: Path) -> None:
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConversionError, match=r"found: weights.gguf"):
        detect_format(tmp_path)


def test_plain_peft_adapter_needs_no_conversion_and_converts_byte_for_byte(
    pong: Path, tmp_path: Path
) -> None:
    assert needs_conversion(pong) is False
    out = convert_to_peft(pong, tmp_path / "out", None, "my-base")
    assert sorted(p.name for p in out.iterdir()) == PEFT_FILES
    assert (out / "adapter_model.safetensors").read_bytes() == (
        pong / "adapter_model.safetensors"
    ).read_bytes()
    config = read_config(out)
    _assert_complete_config(config)
    assert config["base_model_name_or_path"] == "my-base"
    assert (config["r"], config["lora_alpha"]) == (8, 16)


def test_mlx_reexpression_of_a_demo_adapter_converts_back_to_the_same_tensors(
    pong: Path, tmp_path: Path, base_config: dict[str, Any]
) -> None:
    mlx = make_mlx_adapter(pong, tmp_path / "mlx")
    assert needs_conversion(mlx)
    out = convert_to_peft(mlx, tmp_path / "out", base_config, "loragate-demo")
    assert sorted(p.name for p in out.iterdir()) == PEFT_FILES
    _assert_same_tensors(
        load_tensors(out / "adapter_model.safetensors"),
        load_tensors(pong / "adapter_model.safetensors"),
    )
    config, original = read_config(out), read_config(pong)
    _assert_complete_config(config)
    assert (config["r"], config["lora_alpha"]) == (8, 16)  # lora_alpha = scale x rank
    assert sorted(config["target_modules"]) == sorted(original["target_modules"])
    assert validate_adapter(out, base_config, 16).rank == 8


def test_bin_save_with_default_names_converts_back_to_the_same_tensors(
    pong: Path, tmp_path: Path, base_config: dict[str, Any]
) -> None:
    old = make_bin_adapter(pong, tmp_path / "bin")
    assert any(".default." in k for k in _torch_load(old / "adapter_model.bin"))
    out = convert_to_peft(old, tmp_path / "out", base_config, "loragate-demo")
    _assert_same_tensors(
        load_tensors(out / "adapter_model.safetensors"),
        load_tensors(pong / "adapter_model.safetensors"),
    )
    _assert_complete_config(read_config(out))
    validate_adapter(out, base_config, 16)


def test_safetensors_with_default_names_are_renamed(pong: Path, tmp_path: Path) -> None:
    src = tmp_path / "named"
    tensors = {
        k.replace(".lora_B.weight", ".lora_B.default.weight"): v
        for k, v in load_tensors(pong / "adapter_model.safetensors").items()
    }
    save_tensors(src / "adapter_model.safetensors", tensors)
    (src / "adapter_config.json").write_text((pong / "adapter_config.json").read_text())
    assert detect_format(src) == "peft" and needs_conversion(src)
    out = convert_to_peft(src, tmp_path / "out")
    _assert_same_tensors(
        load_tensors(out / "adapter_model.safetensors"),
        load_tensors(pong / "adapter_model.safetensors"),
    )


def test_bin_pickle_that_runs_code_is_refused(tmp_path: Path) -> None:
    import pickle

    class Evil:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (print, ("owned",))

    src = tmp_path / "evil"
    src.mkdir()
    (src / "adapter_model.bin").write_bytes(pickle.dumps({"x": Evil()}, protocol=2))
    with pytest.raises(ConversionError, match="cannot read"):
        convert_to_peft(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_tinker_unembedding_becomes_lm_head_and_config_is_completed(
    pong: Path, tmp_path: Path, base_config: dict[str, Any]
) -> None:
    tinker = make_tinker_dir(pong, tmp_path / "tinker", unembed="random")
    assert json.loads((tinker / "adapter_config.json").read_text()) == {"r": 8, "lora_alpha": 16}
    out = convert_to_peft(tinker, tmp_path / "out", base_config, "loragate-demo")
    got = load_tensors(out / "adapter_model.safetensors")
    src = load_tensors(tinker / "adapter_model.safetensors")
    assert not any("unembed_tokens" in k for k in got)
    assert got["base_model.model.lm_head.lora_A.weight"].shape == (8, 128)
    assert got["base_model.model.lm_head.lora_B.weight"].shape == (384, 8)
    _assert_same_tensors(
        {k: v for k, v in got.items() if "lm_head" not in k},
        {k: v for k, v in src.items() if "unembed" not in k},
    )
    config = read_config(out)
    _assert_complete_config(config)
    assert config["base_model_name_or_path"] == "loragate-demo"
    assert config["target_modules"] == sorted([*read_config(pong)["target_modules"], "lm_head"])
    assert "lm_head" in validate_adapter(out, base_config, 16).target_modules


def test_tinker_unembedding_goes_to_embed_tokens_when_the_base_ties_embeddings(
    pong: Path, tmp_path: Path, base_config: dict[str, Any]
) -> None:
    tinker = make_tinker_dir(pong, tmp_path / "tinker", unembed="random")
    tied = {**base_config, "tie_word_embeddings": True}
    out = convert_to_peft(tinker, tmp_path / "out", tied, None)
    got = load_tensors(out / "adapter_model.safetensors")
    assert "base_model.model.model.embed_tokens.lora_A.weight" in got
    assert "base_model.model.lm_head.lora_A.weight" not in got
    assert "embed_tokens" in read_config(out)["target_modules"]


def test_tinker_moe_experts_are_split_per_expert_sharing_the_size_one_side(tmp_path: Path) -> None:
    import torch

    src, tensors = make_tinker_moe_dir(tmp_path / "moe", experts=3, rank=4)
    out = convert_to_peft(src, tmp_path / "out", {"num_experts": 3}, "some-moe")
    got = load_tensors(out / "adapter_model.safetensors")
    stem = "base_model.model.model.layers.0.mlp.experts"
    w1a, w1b = tensors[f"{stem}.w1.lora_A.weight"], tensors[f"{stem}.w1.lora_B.weight"]
    w2a, w2b = tensors[f"{stem}.w2.lora_A.weight"], tensors[f"{stem}.w2.lora_B.weight"]
    for expert in range(3):
        assert torch.equal(got[f"{stem}.{expert}.gate_proj.lora_A.weight"], w1a[0])
        assert torch.equal(got[f"{stem}.{expert}.gate_proj.lora_B.weight"], w1b[expert])
        assert torch.equal(got[f"{stem}.{expert}.down_proj.lora_A.weight"], w2a[expert])
        assert torch.equal(got[f"{stem}.{expert}.down_proj.lora_B.weight"], w2b[0])
        assert f"{stem}.{expert}.up_proj.lora_A.weight" in got
    assert not any(".w1." in k or ".w2." in k or ".w3." in k for k in got)
    config = read_config(out)
    assert config["target_modules"] == ["down_proj", "gate_proj", "q_proj", "up_proj"]
    assert (config["r"], config["lora_alpha"]) == (4, 8)


def test_tinker_adapter_for_a_vision_language_base_gets_the_text_model_prefix(
    pong: Path, tmp_path: Path
) -> None:
    tinker = make_tinker_dir(pong, tmp_path / "tinker", unembed=None)
    idefics3 = {"model_type": "idefics3", "text_config": {"hidden_size": 128}}
    out = convert_to_peft(tinker, tmp_path / "out", idefics3, None)
    keys = list(load_tensors(out / "adapter_model.safetensors"))
    assert keys and all(k.startswith("base_model.model.model.text_model.layers.") for k in keys)


def test_tinker_config_without_lora_alpha_is_refused(pong: Path, tmp_path: Path) -> None:
    tinker = make_tinker_dir(pong, tmp_path / "tinker", unembed=None)
    (tinker / "adapter_config.json").write_text(json.dumps({"r": 8}))
    with pytest.raises(ConversionError, match="no lora_alpha"):
        convert_to_peft(tinker, tmp_path / "out")


def test_config_rank_that_disagrees_with_the_weights_is_refused(pong: Path, tmp_path: Path) -> None:
    tinker = make_tinker_dir(pong, tmp_path / "tinker", unembed=None)
    (tinker / "adapter_config.json").write_text(json.dumps({"r": 32, "lora_alpha": 32}))
    with pytest.raises(ConversionError, match="r=32 but the weights have rank 8"):
        convert_to_peft(tinker, tmp_path / "out")


def test_mlx_dora_adapter_is_refused(pong: Path, tmp_path: Path) -> None:
    mlx = make_mlx_adapter(pong, tmp_path / "mlx")
    config = json.loads((mlx / "adapter_config.json").read_text())
    config["fine_tune_type"] = "dora"
    (mlx / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="dora fine-tune"):
        convert_to_peft(mlx, tmp_path / "out")


def test_vi_run_converts_its_model_adapter(pong: Path, tmp_path: Path) -> None:
    run = make_vi_run(pong, tmp_path / "run_abc")
    out = convert_to_peft(run, tmp_path / "out", None, "base")
    _assert_same_tensors(
        load_tensors(out / "adapter_model.safetensors"),
        load_tensors(pong / "adapter_model.safetensors"),
    )


def test_vi_run_without_an_adapter_says_to_serve_model_full(tmp_path: Path) -> None:
    run = make_vi_run(None, tmp_path / "run_full")
    with pytest.raises(ConversionError, match="model_full"):
        convert_to_peft(run, tmp_path / "out")


def test_conversion_refuses_a_non_empty_output_directory(pong: Path, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(ConversionError, match="not empty"):
        convert_to_peft(pong, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "x"


def test_failed_conversion_leaves_no_output_directory(pong: Path, tmp_path: Path) -> None:
    tinker = make_tinker_dir(pong, tmp_path / "tinker", unembed=None)
    (tinker / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    with pytest.raises(ConversionError):
        convert_to_peft(tinker, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_subprocess_conversion_matches_in_process_conversion(
    pong: Path, demo_dir: Path, tmp_path: Path
) -> None:
    mlx = make_mlx_adapter(pong, tmp_path / "mlx")
    out = convert_in_subprocess(mlx, tmp_path / "out", demo_base_dir(demo_dir))
    _assert_same_tensors(
        load_tensors(out / "adapter_model.safetensors"),
        load_tensors(pong / "adapter_model.safetensors"),
    )
    assert read_config(out)["base_model_name_or_path"] == str(demo_base_dir(demo_dir))


def test_subprocess_conversion_surfaces_the_childs_message(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    with pytest.raises(ConversionError) as caught:
        convert_in_subprocess(tmp_path / "src", tmp_path / "out", None)
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'src'} holds no adapter I know")
    assert "Traceback" not in message


def test_a_full_disk_in_the_child_comes_back_as_enospc_not_as_a_bad_adapter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import errno

    from loragate.adapters.intake.convert import child_process

    def write_to_a_full_disk(*args: Any) -> None:
        with open("/dev/full", "wb") as handle:  # a real ENOSPC, from the kernel
            handle.write(b"weights")
            handle.flush()

    monkeypatch.setattr(child_process, "convert_to_peft", write_to_a_full_disk)
    assert child_process.main([str(tmp_path / "src"), str(tmp_path / "out")]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(child_process.ERROR_MARKER + child_process.NO_SPACE)

    # The parent reads that line from a real child process and raises ENOSPC, which the
    # pipeline answers as a 507, not as "adapter rejected".
    child = tmp_path / "child-python"
    child.write_text(f"#!/bin/sh\necho {line!r} >&2\nexit 1\n")
    child.chmod(0o755)
    with pytest.raises(OSError) as caught:
        convert_in_subprocess(tmp_path / "src", tmp_path / "out", None, python=str(child))
    assert caught.value.errno == errno.ENOSPC and "No space left on device" in str(caught.value)


@pytest.mark.parametrize("r", [float("inf"), float("nan"), 0, True])
def test_a_rank_that_is_not_a_whole_number_is_a_conversion_error(r: Any) -> None:
    from loragate.adapters.intake.convert import build_peft_config

    shapes = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (8, 16)}
    with pytest.raises(ConversionError, match="r must be a positive whole number"):
        build_peft_config({"r": r, "lora_alpha": 16}, shapes, "peft", None)


def test_importing_the_adapter_modules_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import loragate.adapters.intake.convert, loragate.adapters.intake.validate, loragate.adapters.intake.sources\n"
        "import loragate.base_model.resolve, loragate.base_model.vi_runs\n"
        "heavy = [m for m in ('torch', 'safetensors', 'numpy', 'transformers', 'peft', 'tinker', 'vi')"
        " if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _torch_load(path: Path) -> dict[str, Any]:
    import torch

    return dict(torch.load(path, weights_only=True))
