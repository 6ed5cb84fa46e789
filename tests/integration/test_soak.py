"""CI's short soak: scripts/soak.py as a user runs it, 90 s instead of 20 minutes.

Load on the base model and every demo adapter, swaps every 10 s, the hostile-input corpus
every second and one engine kill halfway; the script's verdict (no lost or misrouted
request, every hostile request refused clearly with nothing fetched, no adapter lost, RSS
and descriptors flat) must pass.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_soak_with_hostile_requests_and_an_engine_kill_passes(tmp_path: Path) -> None:
    result_file = tmp_path / "soak.json"
    argv = [sys.executable, str(ROOT / "scripts" / "soak.py"), "--duration", "90"]
    argv += ["--concurrency", "3", "--swap-every", "10", "--hostile-every", "1"]
    argv += ["--cache-dir", str(tmp_path / "cache"), "--json", str(result_file)]
    run = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    report = run.stdout[-6000:] + run.stderr[-3000:]
    assert run.returncode == 0, report
    result = json.loads(result_file.read_text())
    assert result["verdict"] == {"pass": True, "problems": []}, report
    assert result["kill"] is not None and result["kill"]["ready_again_at"] is not None, report
    kinds = {case for _, case, _ in result["hostile"]}
    assert len(kinds) >= 40, (len(kinds), report)  # the whole corpus went round at least once
    assert len(result["swaps"]) >= 5, report
    assert "pong" in result["adapters_after"] and "fox" in result["adapters_after"], report
