"""Where the bundled demo lives and what it contains. Light: no heavy imports."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BASE_DIRNAME = "base"
RECIPE_FILENAME = "RECIPE"
DEMO_MODEL_NAME = "loragate-demo"


@dataclass(frozen=True)
class DemoAdapter:
    name: str
    phrase: str


# Each adapter is trained to answer its phrase to any chat prompt, so tests can prove which
# adapter served a request. Three are needed to exercise several adapters in one batch.
DEMO_ADAPTERS = (
    DemoAdapter("pong", " PONG PONG"),
    DemoAdapter("fox", " fox fox fox"),
    DemoAdapter("owl", " hoot hoot"),
)


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "loragate"


def default_demo_dir() -> Path:
    override = os.environ.get("LORAGATE_DEMO_DIR")
    return Path(override) if override else default_cache_dir() / "demo"


def demo_base_dir(demo_dir: Path) -> Path:
    return demo_dir / BASE_DIRNAME


def demo_adapter_dir(demo_dir: Path, name: str) -> Path:
    return demo_dir / "adapters" / name


def ensure_demo(demo_dir: Path | None = None, python: str | None = None) -> Path:
    """Build the demo if it is missing or stale, in a child process so torch stays out of ours."""
    target = (demo_dir or default_demo_dir()).expanduser().resolve()
    subprocess.run(
        [python or sys.executable, "-m", "loragate.demo.build", str(target)],
        check=True,
    )
    return target
