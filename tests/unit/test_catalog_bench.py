"""scripts/catalog_bench.py and scripts/gpu_check.sh.

The bench runs here in its quick mode: real ``gateway serve --config`` processes with two
models, whose engines are the stand-in (``tools.bench.fake_engine``), in each boot mode; its
table and conclusion are checked on made-up runs too. The real engines' numbers are in
docs/benchmarks.md. The GPU check cannot run without a GPU: here it must say so and exit 2
before it sets anything up.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from loragate.settings.catalog import CatalogModel
from tools.bench import catalog_bench
from tools.bench.catalog_bench import (
    MODES,
    SLEEP_UNSUPPORTED,
    ModeResult,
    Run,
    conclusion,
    sleep_supported,
    table,
)

REPO = Path(__file__).resolve().parents[2]
GPU_CHECK = REPO / "scripts" / "gpu_check.sh"
NO_GPU = "no NVIDIA GPU here"


def test_the_quick_bench_times_each_boot_mode_on_a_real_gateway_and_concludes(
    demo_dir: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "catalog_bench.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines() if "|" in line}
    for mode in MODES:
        # boot, cold, while evicting: each a median and its one run, then the difference.
        cells = [cell.strip() for cell in rows[mode].split("|")[2:-1]]
        seconds = [median_of(cell) for cell in cells[:3]]
        assert all(value > 0 for value in seconds), rows[mode]
        assert float(cells[3]) == pytest.approx(seconds[2] - seconds[1], abs=0.11)
    assert done.stdout.splitlines()[-1].startswith("conclusion: ")
    # Each run's progress line names its mode: the modes took turns.
    assert [line.split()[2].rstrip(":") for line in done.stderr.splitlines()] == list(MODES)


def test_with_sleep_mode_the_quick_bench_also_times_the_wake_of_the_model_asleep(
    demo_dir: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "catalog_bench.py"), "--quick", "--sleep",
         "--mode", "multiprocess"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    header, _, row = [line for line in done.stdout.splitlines() if "|" in line]
    assert header.endswith("| asleep model, first token s |")
    cells = [cell.strip() for cell in row.split("|")[2:-1]]
    # The wake is no boot: sooner than the cold model's first token, which includes one.
    assert median_of(cells[4]) < median_of(cells[1])
    assert "a model asleep answers its first token in" in done.stdout.splitlines()[-1]


def median_of(cell: str) -> float:
    """A quick run's cell, ``MEDIAN (EACH)``: one run, so both are the same."""
    found = re.fullmatch(r"([\d.]+) \(([\d.]+)\)", cell)
    assert found is not None and found[1] == found[2], cell
    return float(found[1])


def runs(mode: str, *timings: tuple[float, float, float]) -> ModeResult:
    return ModeResult(mode, [Run(boot, cold, evicting) for boot, cold, evicting in timings])


def test_the_table_gives_medians_each_run_and_what_an_eviction_adds() -> None:
    results = [
        runs("multiprocess", (36.0, 30.0, 33.0), (34.0, 32.0, 36.0), (90.0, 31.0, 35.0)),
        runs("single-process", (23.0, 20.0, 22.0), (22.0, 21.0, 24.0), (24.0, 22.0, 23.0)),
    ]
    lines = table(results).splitlines()
    assert lines[2] == (
        "| multiprocess | 36.0 (36.0, 34.0, 90.0) | 31.0 (30.0, 32.0, 31.0) | "
        "35.0 (33.0, 36.0, 35.0) | +4.0 |"
    )
    assert lines[3].startswith("| single-process | 23.0 (23.0, 22.0, 24.0) | 21.0 ")
    assert conclusion(results) == (
        "conclusion: single-process answers a cold model 10.0 s sooner (21.0 vs 31.0 s; boot "
        "23.0 vs 36.0 s); evicting another model first adds +4.0 s (multiprocess), "
        "+2.0 s (single-process)"
    )
    assert conclusion(results[:1]) == (
        "conclusion: multiprocess boots in 36.0 s and answers a cold model's first token in "
        "31.0 s; evicting another model first adds +4.0 s (multiprocess)"
    )


def test_sleep_is_asked_of_the_settings_and_a_refusal_is_said_before_any_boot(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert sleep_supported() == ("sleep" in CatalogModel.model_fields)
    # A build whose settings refuse the key: the bench says so and boots nothing.
    monkeypatch.setattr(catalog_bench, "sleep_supported", lambda: False)
    monkeypatch.setattr(catalog_bench, "ensure_demo", lambda: pytest.fail("booted"))
    assert catalog_bench.main(["--sleep", "--quick"]) == 3
    assert capsys.readouterr().err.strip() == SLEEP_UNSUPPORTED


def test_the_gpu_check_parses() -> None:
    done = subprocess.run(["bash", "-n", str(GPU_CHECK)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "set -euo pipefail" in GPU_CHECK.read_text()


def run_gpu_check(path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/bash", str(GPU_CHECK)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PATH": path},
    )


def test_without_nvidia_smi_the_gpu_check_exits_2_saying_why(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(Path("/usr/bin/dirname"))
    done = run_gpu_check(str(bin_dir))
    assert done.returncode == 2, done
    assert NO_GPU in done.stderr
    assert done.stdout == ""  # nothing set up, nothing started


def test_with_an_nvidia_smi_that_finds_no_gpu_the_gpu_check_exits_2(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "nvidia-smi"
    stub.write_text(
        "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the "
        "NVIDIA driver.' >&2\nexit 9\n"
    )
    stub.chmod(0o755)
    done = run_gpu_check(f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert done.returncode == 2, done
    assert NO_GPU in done.stderr
    assert done.stdout == ""
