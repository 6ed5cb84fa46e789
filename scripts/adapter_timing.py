#!/usr/bin/env python3
"""Conversion time and cached-load time for the demo adapters.

Part 1 (no engine): each demo adapter, re-expressed in every layout loragate converts from,
goes through the adapter pipeline (fetch, convert, validate, store) into a fresh store: the
cold time; then the same source again: the cached time (content already in the store).
Part 2 (real engine): through a running `gateway serve`, an admin PUT of a new adapter (store
+ engine load) and a rollback to a version already in the store (engine load only).

    .venv/bin/python scripts/adapter_timing.py [--no-engine]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loragate.adapters.intake.pipeline import AdapterPipeline
from loragate.adapters.store import AdapterStore
from loragate.demo.layout import DEMO_ADAPTERS, demo_adapter_dir, demo_base_dir, ensure_demo
from tests import adapter_fixtures as fx
from tools.harness import GatewayProcess


def timed(fn, *args):  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    result = fn(*args)
    return result, (time.perf_counter() - started) * 1000


def pipeline_times(demo: Path, work: Path) -> None:
    base = demo_base_dir(demo)
    config = json.loads((base / "config.json").read_text())
    layouts = {
        "peft (as trained)": lambda src, out: src,
        "old peft .bin": lambda src, out: fx.make_bin_adapter(src, out),
        "mlx": lambda src, out: fx.make_mlx_adapter(src, out),
        "tinker archive": lambda src, out: fx.make_tinker_archive(
            src, out.with_suffix(".tar"), out.parent / f"{out.name}-w"
        ),
    }
    print(f"{'layout':<20} {'adapter':<6} {'cold ms':>9} {'cached ms':>10}")
    for label, make in layouts.items():
        store = AdapterStore(work / f"store-{len(label)}-{label[:4]}")
        pipeline = AdapterPipeline(store=store, base_dir=base, base_config=config, max_lora_rank=16)
        colds, warms = [], []
        for adapter in DEMO_ADAPTERS:
            source = make(
                demo_adapter_dir(demo, adapter.name), work / f"{label[:4]}-{adapter.name}"
            )
            _, cold = timed(pipeline.prepare, str(source))
            _, warm = timed(pipeline.prepare, str(source))
            colds.append(cold)
            warms.append(warm)
            print(f"{label:<20} {adapter.name:<6} {cold:>9.1f} {warm:>10.1f}")
        print(
            f"{label:<20} {'median':<6} {statistics.median(colds):>9.1f} {statistics.median(warms):>10.1f}"
        )


def engine_times(demo: Path, work: Path) -> None:
    gateway = GatewayProcess(cache_dir=work / "gateway").start()
    try:
        gateway.wait_ready(600)
        puts, rollbacks = [], []
        for round_ in range(3):
            for adapter in DEMO_ADAPTERS:
                name = f"t{round_}-{adapter.name}"
                started = time.perf_counter()
                gateway.admin(
                    "PUT",
                    f"/admin/adapters/{name}",
                    json={"source": str(demo_adapter_dir(demo, adapter.name))},
                ).raise_for_status()
                puts.append((time.perf_counter() - started) * 1000)
            gateway.admin(
                "PUT",
                f"/admin/adapters/t{round_}-pong",
                json={"source": str(demo_adapter_dir(demo, "fox"))},
            ).raise_for_status()
            started = time.perf_counter()
            gateway.admin("POST", f"/admin/adapters/t{round_}-pong/rollback").raise_for_status()
            rollbacks.append((time.perf_counter() - started) * 1000)
    finally:
        gateway.stop()
    print(
        f"admin PUT, new adapter (store + engine load): median {statistics.median(puts):.1f} ms, max {max(puts):.1f} ms"
    )
    print(
        f"rollback to a stored version (verify + engine load): median {statistics.median(rollbacks):.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--no-engine", action="store_true", help="skip part 2")
    args = parser.parse_args()
    demo = ensure_demo()
    with tempfile.TemporaryDirectory(prefix="loragate-timing-") as tmp:
        pipeline_times(demo, Path(tmp))
        if not args.no_engine:
            engine_times(demo, Path(tmp))


if __name__ == "__main__":
    main()
