"""scripts/setup.sh's checks, against faked Pythons, nvidia-smi and compilers.

Each test runs the real script with ``--check-only`` (it stops after its checks, installing
nothing) and a PATH that holds only a few core tools and the fakes of the case: scripts that
answer ``--version`` with a Python's version, ``nvidia-smi`` with a driver version and compute
capability, ``gcc`` by existing. A refusal must say what is missing and how to get it; the good
case must reach the install step.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SETUP = REPO / "scripts" / "setup.sh"
# What the script runs before its install step, besides bash's builtins and the fakes.
CORE_TOOLS = ("cat", "cut", "dirname", "head", "sed", "sha256sum", "tr")


@pytest.fixture
def machine(tmp_path: Path) -> Machine:
    return Machine(tmp_path)


class Machine:
    """A PATH of core tools plus the fakes a test adds, and a venv location of its own."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "bin"
        self.bin.mkdir()
        self.core = root / "core"
        self.core.mkdir()
        for tool in CORE_TOOLS:
            found = shutil.which(tool)
            assert found is not None, tool
            (self.core / tool).symlink_to(found)
        self.venv = root / "venv"
        self.include = root / "include"  # where the fake Pythons keep their headers

    def fake(self, name: str, body: str, where: Path | None = None) -> Path:
        path = (where or self.bin) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
        return path

    def python(self, name: str, version: str, where: Path | None = None) -> Path:
        """A Python that says its version and, asked anything else (the headers probe),
        prints its include dir."""
        return self.fake(
            name,
            f'if [ "$1" = --version ]; then echo "Python {version}"; exit 0; fi\n'
            f'echo "{self.include}"',
            where,
        )

    def headers(self) -> None:
        self.include.mkdir(exist_ok=True)
        (self.include / "Python.h").write_text("/* the fake Python's header */\n")

    def gpu(self, driver: str, compute: str) -> None:
        self.fake(
            "nvidia-smi",
            'case "$*" in\n'
            '  *-L*) echo "GPU 0: NVIDIA GeForce RTX 4090 (UUID: GPU-0a1b2c3d)" ;;\n'
            f'  *driver_version*) echo "{driver}, {compute}" ;;\n'
            "  *) exit 9 ;;\n"
            "esac",
        )

    def good_gpu_desktop(self, driver: str = "580.65.06", compute: str = "8.9") -> None:
        self.python("python3.12", "3.12.3")
        self.headers()
        self.gpu(driver, compute)
        self.fake("gcc", "exit 0")

    def setup(self, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["/bin/bash", str(SETUP), "--check-only"],
            capture_output=True,
            text=True,
            timeout=60,
            env={
                "PATH": f"{self.bin}{os.pathsep}{self.core}",
                "HOME": str(self.root),
                "LORAGATE_VENV": str(self.venv),
                **env,
            },
        )


def refused(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1, done
    assert "Would install" not in done.stdout
    return done.stderr


def test_with_only_python_3_10_and_3_11_2_setup_refuses_naming_them_and_how_to_get_one(
    machine: Machine,
) -> None:
    machine.python("python3.11", "3.11.2")
    machine.python("python3", "3.10.12")
    message = refused(machine.setup())
    assert "loragate needs Python 3.11.4 or later" in message
    assert f"python3.11 3.11.2 ({machine.bin / 'python3.11'})" in message
    assert f"python3 3.10.12 ({machine.bin / 'python3'})" in message
    assert "uv python install 3.12" in message
    assert "ppa:deadsnakes/ppa" in message
    assert not machine.venv.exists()


def test_without_any_python_setup_says_so_and_how_to_get_one(machine: Machine) -> None:
    message = refused(machine.setup())
    assert "no python3.11, python3.12, python3.13 nor python3 that runs" in message
    assert "uv python install" in message


def test_the_first_python_new_enough_is_taken_and_a_shim_that_does_not_run_is_passed_over(
    machine: Machine,
) -> None:
    # pyenv's shim for a version not selected exists on PATH but exits 127.
    machine.fake("python3.13", 'echo "pyenv: python3.13: command not found" >&2; exit 127')
    machine.python("python3.12", "3.12.3")
    machine.python("python3", "3.10.12")
    done = machine.setup()
    assert done.returncode == 0, done
    assert f"Python 3.12.3: {machine.bin / 'python3.12'}" in done.stdout
    assert "Would install loragate[cpu,convert]" in done.stdout


def test_python_3_11_is_taken_before_newer_ones_and_the_local_torch_wheel_must_match_it(
    machine: Machine,
) -> None:
    # The CPU build's torch comes from a local wheel when pip knows one (its find-links); the
    # machine's is built for CPython 3.11, and pip installs no cp311 wheel on 3.13.
    wheels = machine.root / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_text("")
    pip_config = f"echo \"global.find-links='{wheels}'\""
    for name, version in (("python3.11", "3.11.9"), ("python3.13", "3.13.1")):
        machine.fake(
            name,
            f'if [ "$1" = --version ]; then echo "Python {version}"; exit 0; fi\n'
            f'if [ "$*" = "-m pip config list" ]; then {pip_config}; exit 0; fi\n'
            f'echo "{machine.include}"',
        )
    done = machine.setup()
    assert done.returncode == 0, done
    assert f"Python 3.11.9: {machine.bin / 'python3.11'}" in done.stdout
    assert f"torch 2.13.0+cpu from the local wheel {wheels}/torch-2.13.0+cpu-cp311-" in done.stdout
    # Named by PYTHON, 3.13 is taken, and the cp311 wheel is not mistaken for its own.
    newer = machine.setup(PYTHON=str(machine.bin / "python3.13"))
    assert newer.returncode == 0, newer
    assert "from PyTorch's CPU index (pip's find-links have no cp313 wheel of it)" in newer.stdout


def test_python_3_11_4_is_new_enough_and_python_named_by_env_is_checked_too(
    machine: Machine,
) -> None:
    machine.python("python3", "3.11.4")
    assert machine.setup().returncode == 0
    old = machine.python("py-old", "3.11.2", machine.root / "elsewhere")
    message = refused(machine.setup(PYTHON=str(old)))
    assert f"PYTHON={old} is Python 3.11.2; loragate needs 3.11.4 or later" in message


def test_a_venv_made_with_an_old_python_is_refused_with_how_to_start_over(
    machine: Machine,
) -> None:
    machine.python("python3.12", "3.12.3")
    machine.python("python", "3.10.12", machine.venv / "bin")
    message = refused(machine.setup())
    assert f"{machine.venv} was made with Python 3.10.12" in message
    assert f"rm -rf {machine.venv}" in message


def test_a_driver_too_old_for_cuda_13_is_refused_naming_the_driver_needed(
    machine: Machine,
) -> None:
    machine.good_gpu_desktop(driver="550.54.15")
    message = refused(machine.setup())
    assert (
        "the NVIDIA driver is 550.54.15, but CUDA 13 (for vLLM 0.32's CUDA wheels) needs driver "
        "580 or later"
    ) in message
    assert "sudo apt-get install nvidia-driver-580" in message
    assert "LORAGATE_ENGINE=cpu scripts/setup.sh" in message


def test_the_driver_needed_follows_the_cuda_of_the_torch_already_installed(
    machine: Machine,
) -> None:
    # A venv whose torch is built for CUDA 12.8: driver 550 runs it (12.x needs 525.60.13).
    machine.good_gpu_desktop(driver="550.54.15")
    machine.python("python", "3.12.3", machine.venv / "bin")
    torch = machine.venv / "lib" / "python3.12" / "site-packages" / "torch"
    torch.mkdir(parents=True)
    (torch / "version.py").write_text(
        "from typing import Optional\n__version__ = '2.9.1+cu128'\ncuda: Optional[str] = '12.8'\n"
    )
    done = machine.setup()
    assert done.returncode == 0, done
    assert (
        f"driver 550.54.15 runs CUDA 12.8 (for the torch in {machine.venv}; it needs driver "
        "525.60.13 or later)"
    ) in done.stdout
    # And 520 does not: the refusal names 525.60.13.
    machine.gpu("520.61.05", "8.9")
    assert "CUDA 12.8 (for the torch in" in refused(machine.setup())


def test_a_gpu_older_than_cuda_13_supports_is_refused(machine: Machine) -> None:
    machine.good_gpu_desktop(compute="6.1")  # a GTX 1080
    message = refused(machine.setup())
    assert "compute capability is 6.1" in message
    assert "CUDA 13 (for vLLM 0.32's CUDA wheels) runs on 7.5 and up" in message


def test_without_a_c_compiler_setup_refuses_naming_how_to_install_one(machine: Machine) -> None:
    machine.good_gpu_desktop()
    (machine.bin / "gcc").unlink()
    message = refused(machine.setup())
    assert "no C compiler (gcc or clang)" in message
    assert "Triton compiles vLLM's LoRA kernels" in message
    assert "sudo apt-get install build-essential" in message
    # CC names the compiler Triton uses: one that is not there is refused too.
    assert "CC=cc-that-is-not-there" in refused(machine.setup(CC="cc-that-is-not-there"))
    machine.fake("clang", "exit 0")
    assert machine.setup().returncode == 0


def test_without_python_headers_setup_refuses_naming_the_dev_package(machine: Machine) -> None:
    machine.good_gpu_desktop()
    (machine.include / "Python.h").unlink()
    message = refused(machine.setup())
    assert "Python.h is missing" in message
    assert "sudo apt-get install python3.12-dev" in message


def test_a_desktop_gpu_that_passes_every_check_goes_on_to_the_install(machine: Machine) -> None:
    machine.good_gpu_desktop()
    done = machine.setup()
    assert done.returncode == 0, done
    assert "GPU: NVIDIA GeForce RTX 4090, driver 580.65.06, compute capability 8.9" in done.stdout
    assert f"C compiler for Triton: {machine.bin / 'gcc'}" in done.stdout
    assert "Would install loragate[gpu,convert]" in done.stdout
    assert "download-kernels" not in done.stdout  # FlashInfer fetches nothing below 9.0
    assert not machine.venv.exists()


def test_on_compute_capability_9_the_flashinfer_kernels_are_fetched_at_setup(
    machine: Machine,
) -> None:
    machine.good_gpu_desktop(compute="9.0")
    done = machine.setup()
    assert done.returncode == 0, done
    assert "FlashInfer's kernels (compute capability 9.0)" in done.stdout
    assert "-m vllm.entrypoints.cli.main download-kernels" in done.stdout
    skipped = machine.setup(LORAGATE_FLASHINFER_KERNELS="skip")
    assert "download-kernels" not in skipped.stdout
    assert "left to the first boot" in skipped.stdout


def test_a_nvidia_smi_that_lists_no_gpu_sets_up_the_cpu_build(machine: Machine) -> None:
    machine.python("python3.12", "3.12.3")
    machine.fake("nvidia-smi", "echo 'NVIDIA-SMI has failed' >&2; exit 9")
    done = machine.setup()
    assert done.returncode == 0, done
    assert "Would install loragate[cpu,convert]" in done.stdout


def test_an_unknown_argument_is_a_usage_error(machine: Machine) -> None:
    done = subprocess.run(
        ["/bin/bash", str(SETUP), "--frobnicate"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2
    assert "usage: scripts/setup.sh [--test] [--check-only]" in done.stderr
