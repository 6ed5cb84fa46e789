"""The gateway process stays light at start-up: what `gateway serve` imports before it serves
holds none of the engine's stack, and none of the libraries only a download or a trace needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "vllm", "transformers", "huggingface_hub", "httpcore", "opentelemetry", "numpy")

PROBE = """
import json, sys
from loragate import cli
from loragate.gateway.app import create_app
from loragate.gateway.server.serve import GatewayServer
from loragate.settings import Settings
app = create_app(Settings(upstream_url="http://127.0.0.1:9/v1"))
GatewayServer(app, app.state.gateway.settings, gateway=app.state.gateway)
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


def test_serving_imports_nothing_heavy(tmp_path: Path) -> None:
    env = {**os.environ, "LORAGATE_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=env,
    )
    loaded = set(json.loads(done.stdout.splitlines()[-1]))
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
