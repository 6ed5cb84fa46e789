#!/usr/bin/env python3
"""Recovery after `kill -9` of the engine: time to detect, time to ready, client-visible errors.

Starts `gateway serve` on the demo (or uses --url), keeps a few clients sending requests,
kills the engine's API server with SIGKILL, and reports per trial:
  detect   kill -> supervisor leaves "ready"
  ready    kill -> /health answers 200 again (engine booted, adapters re-applied)
  errors   requests that failed, with their reasons (requests in flight on the killed engine)
  waited   requests sent during the restart that waited and then succeeded

    .venv/bin/python scripts/recovery.py [--trials 3] [--clients 4]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/ is not installed

from tools.harness import GatewayProcess


def client_loop(url: str, stop: threading.Event, log: list[tuple[float, float, int, str]]) -> None:
    body = {"model": "pong", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    with httpx.Client(timeout=300) as http:
        while not stop.is_set():
            started = time.monotonic()
            try:
                response = http.post(f"{url}/v1/chat/completions", json=body)
                code = response.status_code
                reason = "" if code == 200 else response.json().get("error", {}).get("code", "")
            except httpx.HTTPError as exc:
                code, reason = 0, type(exc).__name__
            log.append((started, time.monotonic(), code, reason))


def trial(gateway: GatewayProcess, clients: int) -> dict[str, float | int | str]:
    stop = threading.Event()
    log: list[tuple[float, float, int, str]] = []
    threads = [
        threading.Thread(target=client_loop, args=(gateway.url, stop, log)) for _ in range(clients)
    ]
    for thread in threads:
        thread.start()
    time.sleep(2)
    pid = int(gateway.engine_info()["pid"])
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    detected = ready = None
    while ready is None and time.monotonic() - killed < 600:
        with httpx.Client(timeout=5) as http:
            state = gateway.engine_info()["state"]
            if detected is None and state != "ready":
                detected = time.monotonic()
            if detected is not None and http.get(f"{gateway.url}/health").status_code == 200:
                ready = time.monotonic()
        time.sleep(0.02)
    time.sleep(2)
    stop.set()
    for thread in threads:
        thread.join()
    errors = Counter(reason or str(code) for _, _, code, reason in log if code != 200)
    waited = sum(1 for s, e, code, _ in log if code == 200 and s > killed and ready and s < ready)
    return {
        "detect_ms": round(((detected or killed) - killed) * 1000, 1),
        "ready_s": round(((ready or killed) - killed), 1),
        "requests": len(log),
        "failed": sum(errors.values()),
        "why": ", ".join(f"{k} x{v}" for k, v in errors.items()) or "-",
        "waited_then_ok": waited,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="loragate-recovery-") as tmp:
        gateway = GatewayProcess(
            cache_dir=Path(tmp), env={"LORAGATE_CRASH_LOOP_LIMIT": "100"}
        ).start()
        try:
            gateway.wait_ready(600)
            results = [trial(gateway, args.clients) for _ in range(args.trials)]
        finally:
            gateway.stop()
    print(
        f"{'trial':>5} {'detect ms':>10} {'ready s':>8} {'requests':>9} {'failed':>7} {'waited->ok':>11}  why"
    )
    for index, row in enumerate(results, 1):
        print(
            f"{index:>5} {row['detect_ms']:>10} {row['ready_s']:>8} {row['requests']:>9} "
            f"{row['failed']:>7} {row['waited_then_ok']:>11}  {row['why']}"
        )
    print(
        f"median: detect {statistics.median(float(r['detect_ms']) for r in results):.1f} ms, "
        f"ready {statistics.median(float(r['ready_s']) for r in results):.1f} s"
    )


if __name__ == "__main__":
    main()
