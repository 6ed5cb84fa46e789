"""`pip install .` ships the product only: no bench, soak, harness or stand-in engine."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_loragate_and_no_development_tools(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True,
        timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("loragate-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {
        name.split("/", 1)[0] for name in names if not name.split("/", 1)[0].endswith(".dist-info")
    }
    assert top == {"loragate"}, top
    tooling = [n for n in names if any(w in n for w in ("bench", "soak", "harness", "fake_engine"))]
    assert tooling == [], tooling
    assert "loragate/gateway/app.py" in names
    assert "loragate/engine_plugin/__init__.py" in names


def test_the_package_never_imports_the_tools() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "loragate").rglob("*.py")
        if "from tools" in path.read_text() or "import tools" in path.read_text()
    ]
    assert offenders == []
