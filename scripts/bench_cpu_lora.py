"""What LoRA costs on vLLM's CPU build, with loragate's CPU LoRA ops off and on, in one run.

For each setting (``LORAGATE_CPU_LORA_OPS=0``, then ``1``) it starts ``gateway serve`` on a real
model with one adapter, its engine wrapped by ``tools.bench.engine_tap`` so the same
engine can be asked directly, and sends interleaved rounds (random order within each round) of:

- ``engine base``: the engine, base model asked plainly (what `vllm serve` users get);
- ``gateway base``: the gateway, base model (plugin off: through the all-zero adapter);
- ``engine adapter`` / ``gateway adapter``: the adapter, asked of each.

It prints paired medians (each request against the same round's ``engine base``) at
``max_tokens=1`` and ``max_tokens=32``, and the targets of issue 14: gateway base within 5%
of engine base, adapter requests no more than 1.5x engine base.

    .venv/bin/python scripts/bench_cpu_lora.py                 # the real demo (SmolLM2-135M)
    .venv/bin/python scripts/bench_cpu_lora.py --rounds 10     # quicker
    .venv/bin/python scripts/bench_cpu_lora.py --model DIR --adapter NAME=DIR
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.bench.run import engine_ids, engine_model_for
from tools.bench.targets import GatewayServe

PROMPT = (
    "Write one sentence about the history of the city of Paris and its river, the bridges "
    "across it, and the people who live along its banks today."
)
ENGINE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
PATHS = ("engine base", "gateway base", "engine adapter", "gateway adapter")


def ask(client: httpx.Client, url: str, key: str | None, model: str, max_tokens: int) -> float:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    started = time.perf_counter()
    response = client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed * 1000


def measure(
    model: str, adapter: tuple[str, str], plugin: bool, rounds: int, workdir: Path
) -> dict[int, dict[str, list[float]]]:
    os.environ["LORAGATE_CPU_LORA_OPS"] = "1" if plugin else "0"
    name, source = adapter
    gateway = GatewayServe(
        workdir / ("on" if plugin else "off"),
        ENGINE,
        model=model,
        extra_args=["--model-name", "base", "--lora", f"{name}={source}"],
    )
    try:
        gateway.wait_ready(900)
        record = gateway.engine()
        ids = engine_ids(record)
        adapter_id = engine_model_for(name, "base", ids)
        token = (
            (workdir / ("on" if plugin else "off") / "cache" / "admin-token").read_text().strip()
        )
        info = httpx.get(
            f"{gateway.url}/admin/engine", headers={"Authorization": f"Bearer {token}"}, timeout=10
        ).json()
        print(
            f"plugin {'on' if plugin else 'off'}: cpu_lora_ops={info.get('cpu_lora_ops')}, "
            f"base routing {info.get('base_routing')}",
            flush=True,
        )
        results: dict[int, dict[str, list[float]]] = {}
        # The engine listens on its Unix socket: its own client.
        with httpx.Client(timeout=300) as client, record.client(timeout=300) as direct:
            calls = {
                "engine base": (direct, record.url, record.api_key, "base"),
                "gateway base": (client, gateway.url, None, "base"),
                "engine adapter": (direct, record.url, record.api_key, adapter_id),
                "gateway adapter": (client, gateway.url, None, name),
            }
            for max_tokens in (1, 32):
                for path in PATHS:  # warm every path once
                    ask(*calls[path], max_tokens)
                samples: dict[str, list[float]] = {path: [] for path in PATHS}
                for _ in range(rounds):
                    order = list(PATHS)
                    random.shuffle(order)
                    for path in order:
                        samples[path].append(ask(*calls[path], max_tokens))
                results[max_tokens] = samples
        return results
    finally:
        gateway.stop()


def report(label: str, results: dict[int, dict[str, list[float]]]) -> None:
    for max_tokens, samples in results.items():
        base = samples["engine base"]
        print(f"\n{label}, max_tokens={max_tokens}: median ms, and paired ratio to engine base")
        for path in PATHS:
            ratios = [value / ref for value, ref in zip(samples[path], base, strict=True)]
            print(
                f"  {path:<16} {statistics.median(samples[path]):8.1f} ms   "
                f"x{statistics.median(ratios):.2f}"
            )
        gateway_base = statistics.median(
            v / r for v, r in zip(samples["gateway base"], base, strict=True)
        )
        adapter = max(
            statistics.median(v / r for v, r in zip(samples[p], base, strict=True))
            for p in ("engine adapter", "gateway adapter")
        )
        print(
            f"  targets: gateway base <= x1.05: {'met' if gateway_base <= 1.05 else 'missed'} "
            f"(x{gateway_base:.2f}); adapter <= x1.5: {'met' if adapter <= 1.5 else 'missed'} "
            f"(x{adapter:.2f})"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir (default: the real demo's base)")
    parser.add_argument("--adapter", default=None, help="NAME=DIR (default: a demo adapter)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--only", choices=("off", "on"), default=None)
    args = parser.parse_args(argv)
    model, adapter = args.model, None
    if args.adapter:
        name, _, source = args.adapter.partition("=")
        adapter = (name, source)
    if model is None or adapter is None:
        from loragate.demo.layout import SMOLLM_ADAPTERS, demo_adapter_dir, ensure_smollm_demo

        demo = ensure_smollm_demo()
        model = model or str(demo / "base")
        first = SMOLLM_ADAPTERS[0].name
        adapter = adapter or (first, str(demo_adapter_dir(demo, first)))
    print(f"model {model}, adapter {adapter[0]}, {args.rounds} rounds", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-cpu-lora-") as tmp:
        for plugin in (False, True):
            if args.only and args.only != ("on" if plugin else "off"):
                continue
            results = measure(model, adapter, plugin, args.rounds, Path(tmp))
            report(f"plugin {'on' if plugin else 'off'}", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
