#!/usr/bin/env python3
"""Swap latency under load: admin PUT of a new adapter version -> the new version serving.

Starts `gateway serve` on the demo, keeps clients streaming and non-streaming requests to one
public name, swaps it between two demo adapters N times, and reports the admin call's latency
(it returns once the new version serves), the delay until a client first sees the new phrase,
and client failures (there should be none).

    .venv/bin/python scripts/swap_latency.py [--swaps 20] [--clients 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/ is not installed

from loragate.demo.layout import DEMO_ADAPTERS, demo_adapter_dir, ensure_demo
from tools.harness import GatewayProcess

PHRASES = {a.name: a.phrase.strip() for a in DEMO_ADAPTERS}


def which(text: str) -> str:
    return next((name for name, phrase in PHRASES.items() if phrase in text), "other")


def client(
    url: str, stop: threading.Event, seen: list[tuple[float, str]], failures: list[str]
) -> None:
    body = {
        "model": "live",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    with httpx.Client(timeout=120) as http:
        while not stop.is_set():
            started = time.monotonic()
            response = http.post(f"{url}/v1/chat/completions", json=body)
            if response.status_code != 200:
                failures.append(response.text)
                continue
            seen.append((started, which(response.json()["choices"][0]["message"]["content"])))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--swaps", type=int, default=20)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    demo = ensure_demo()
    sources = {name: str(demo_adapter_dir(demo, name)) for name in ("pong", "fox")}
    with tempfile.TemporaryDirectory(prefix="loragate-swap-") as tmp:
        gateway = GatewayProcess(cache_dir=Path(tmp)).start()
        try:
            gateway.wait_ready(600)
            gateway.admin(
                "PUT", "/admin/adapters/live", json={"source": sources["pong"]}
            ).raise_for_status()
            stop = threading.Event()
            seen: list[tuple[float, str]] = []
            failures: list[str] = []
            threads = [
                threading.Thread(target=client, args=(gateway.url, stop, seen, failures))
                for _ in range(args.clients)
            ]
            for thread in threads:
                thread.start()
            admin_ms, visible_ms = [], []
            for swap in range(args.swaps):
                target = "fox" if swap % 2 == 0 else "pong"
                started = time.monotonic()
                gateway.admin(
                    "PUT", "/admin/adapters/live", json={"source": sources[target]}
                ).raise_for_status()
                returned = time.monotonic()
                admin_ms.append((returned - started) * 1000)
                while not any(t >= returned and p == target for t, p in seen[-50:]):
                    time.sleep(0.005)
                first = min(t for t, p in seen if t >= returned and p == target)
                visible_ms.append((first - started) * 1000)
                time.sleep(0.5)
            stop.set()
            for thread in threads:
                thread.join()
        finally:
            gateway.stop()
    print(
        f"swaps: {args.swaps}, clients: {args.clients}, requests: {len(seen)}, failed: {len(failures)}"
    )
    print(f"wrong phrase (neither adapter): {sum(1 for _, p in seen if p == 'other')}")
    for label, values in (
        ("admin PUT -> returns (new version serving)", admin_ms),
        ("admin PUT -> first request answered by it", visible_ms),
    ):
        print(
            f"{label}: median {statistics.median(values):.1f} ms, p90 {pct(values, 0.9):.1f} ms, max {max(values):.1f} ms"
        )


if __name__ == "__main__":
    main()
