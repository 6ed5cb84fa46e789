"""``scripts/catalog_bench.py``: what a catalog of two models costs its users, per engine boot mode.

A real ``gateway serve --config`` with two models (by default the tiny demo base under two
ids, ``alpha`` with the ``pong`` adapter and ``beta`` with ``fox``) and ``max_loaded_models:
1``, so that one engine at a time is resident. For each ``engine_boot_mode`` (the gateway's
own setting, so the catalog's engines boot the way loragate boots them), each run times:

- **boot**: the gateway's spawn to its first model serving (``alpha`` is preloaded; its
  ``/v1/models`` residency turns ``resident``): the gateway's start, the adapters' intake and
  the engine's boot;
- **cold**: with nothing resident (``alpha`` unloaded by hand), a streamed request for
  ``beta``'s adapter, sent to the first content event: the wait a client sees for a cold model;
- **evicting**: the same for ``alpha``'s adapter while ``beta`` is resident: the gateway must
  unload ``beta`` (the cap of one) before it boots ``alpha``; the swap is checked in
  ``/admin/models``;
- **waking** (with ``--sleep``, ``sleep: true`` in each entry): the same for ``beta``'s adapter
  again, ``beta`` asleep since it was evicted: ``alpha`` goes to sleep and ``beta`` wakes,
  no boot.

Each mode runs with and without a spare engine (``spare_engine``, on by default for a
catalog; ``--no-spare`` leaves those runs out): with one, each cold request is sent once the
spare has finished importing vLLM, as a request that comes a little after the last boot finds
it. The variants take turns run by run, so a busy machine's slow spell falls on each alike. The table
gives each run's seconds and their median; the last line says what they mean.

    .venv/bin/python scripts/catalog_bench.py             # the tiny demo base, 2 runs a mode
    .venv/bin/python scripts/catalog_bench.py --model DIR_A --model DIR_B --runs 3
    .venv/bin/python scripts/catalog_bench.py --quick     # stand-in engines, one run: seconds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import httpx
from pydantic import ValidationError

from loragate.demo.layout import demo_adapter_dir, demo_base_dir, ensure_demo
from loragate.settings.catalog import CatalogModel
from loragate.settings.engine import EngineBootMode
from tools.bench.boot_modes import Variant, variant_name, wait_idle
from tools.harness import GATEWAY, GatewayProcess

MODES: tuple[EngineBootMode, ...] = get_args(EngineBootMode)
# The two catalog ids; with the demo, the adapter of each that the requests name.
IDS = ("alpha", "beta")
DEMO_ADAPTERS = {"alpha": "pong", "beta": "fox"}
STAND_IN = [sys.executable, "-m", "tools.bench.fake_engine"]
REPO = Path(__file__).resolve().parents[2]
SLEEP_UNSUPPORTED = "sleep mode not supported by this build"
ANSWER_TOKENS = 16


@dataclass
class Run:
    """One gateway's timings, in seconds (``waking`` with sleep mode only)."""

    boot: float
    cold: float
    evicting: float
    waking: float | None = None


@dataclass
class ModeResult:
    mode: str
    runs: list[Run] = field(default_factory=list)

    def median(self, name: str) -> float:
        return statistics.median(getattr(run, name) for run in self.runs)


@dataclass
class Catalog:
    """What the gateway serves: each id's catalog entry and the name its requests send."""

    entries: dict[str, dict[str, Any]]
    request_names: dict[str, str]
    stand_in: bool = False
    sleep: bool = False

    def config(self, cache_dir: Path) -> Path:
        """The config file: the entries, ``alpha`` preloaded, a cap of one resident engine."""
        entries = {model_id: dict(entry) for model_id, entry in self.entries.items()}
        entries[IDS[0]]["preload"] = True
        if self.sleep:
            for entry in entries.values():
                entry["sleep"] = True
        values: dict[str, Any] = {"models": entries, "max_loaded_models": 1}
        if self.stand_in:
            values["engine_command"] = STAND_IN
        path = cache_dir / "catalog-bench.yaml"
        path.write_text(json.dumps(values, indent=2))  # JSON is YAML
        return path


def demo_catalog(demo_dir: Path) -> Catalog:
    base = str(demo_base_dir(demo_dir))
    entries: dict[str, dict[str, Any]] = {
        model_id: {"model": base, "lora": [f"{name}={demo_adapter_dir(demo_dir, name)}"]}
        for model_id, name in DEMO_ADAPTERS.items()
    }
    return Catalog(entries, dict(DEMO_ADAPTERS))


def models_catalog(models: list[str]) -> Catalog:
    """Two models of the user's, named ``alpha`` and ``beta``, requested by those ids."""
    return Catalog(
        {model_id: {"model": model} for model_id, model in zip(IDS, models, strict=True)},
        {model_id: model_id for model_id in IDS},
    )


def sleep_supported() -> bool:
    """Whether this build's settings take ``sleep: true`` in a catalog entry."""
    try:
        CatalogModel.model_validate({"model": "m", "sleep": True})
    except ValidationError:
        return False
    return True


def residency(url: str) -> dict[str, str]:
    data = httpx.get(f"{url}/v1/models", timeout=10, trust_env=False).json()["data"]
    return {entry["id"]: entry["residency"] for entry in data}


def wait_resident(process: GatewayProcess, model_id: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        process._check_alive()
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            state = residency(process.url).get(model_id)
            if state == "resident":
                return
            if state == "failed":
                raise RuntimeError(f"model {model_id} failed to boot; log:\n{process.log_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{model_id} not resident within {timeout:g} s: {process.log_tail()}"
            )
        time.sleep(0.1)


def first_token_seconds(url: str, model: str, timeout: float) -> float:
    """Seconds from sending a streamed chat request for ``model`` to its first content event;
    the stream is read to its end, so the model is idle afterwards."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": ANSWER_TOKENS,
        "stream": True,
    }
    sent = time.monotonic()
    first: float | None = None
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, timeout=timeout, trust_env=False
    ) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{model}: {reply.status_code} {reply.read().decode()}")
        for line in reply.iter_lines():
            if first is not None or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
            if (choices[0].get("delta") or {}).get("content"):
                first = time.monotonic() - sent
    if first is None:
        raise RuntimeError(f"{model}: the stream ended without content")
    return first


def catalog_report(process: GatewayProcess) -> dict[str, Any]:
    answer = process.admin("GET", "/admin/models")
    answer.raise_for_status()
    return dict(answer.json())


def spare_ready(process: GatewayProcess, timeout: float) -> None:
    """Wait until the catalog's spare engine waits, done importing vLLM: what a request that
    comes a little after the last boot finds (a sooner one waits for the rest of the import)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reports = process.admin("GET", "/admin/engine").json()
        spare = next(iter(reports.values()))["spare_engine"]
        if spare["launcher_pid"] is not None:
            wait_idle(int(spare["launcher_pid"]), max(deadline - time.monotonic(), 1))
            return
        time.sleep(0.2)
    raise TimeoutError("no spare engine came")


def run_once(variant: Variant, catalog: Catalog, work_dir: Path, timeout: float) -> Run:
    """One gateway in ``variant`` (a boot mode, with or without a spare engine): boot, a cold
    model, a cold model while the other is evicted."""
    mode, spare = variant
    cache_dir = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=work_dir))
    first, second = IDS
    env = {"LORAGATE_ENGINE_BOOT_MODE": mode, "LORAGATE_SPARE_ENGINE": str(spare).lower()}
    if catalog.stand_in:  # the stand-in engine is this checkout's tools.bench.fake_engine
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    process = GatewayProcess(
        cache_dir=cache_dir,
        args=["--config", str(catalog.config(cache_dir))],
        env=env,
        launcher=[str(GATEWAY), "serve"],
    )
    started = time.monotonic()
    process.start()
    try:
        wait_resident(process, first, timeout)
        boot = time.monotonic() - started

        process.admin("POST", f"/admin/models/{first}/unload").raise_for_status()
        held = [m for m in IDS if residency(process.url)[m] == "resident"]
        if held:
            raise RuntimeError(f"not cold: {held} still resident after the unload")
        if spare:
            spare_ready(process, timeout)
        cold = first_token_seconds(process.url, catalog.request_names[second], timeout)

        if spare:
            spare_ready(process, timeout)
        before = catalog_report(process)["swaps"]
        evicting = first_token_seconds(process.url, catalog.request_names[first], timeout)
        report = catalog_report(process)
        last = report["last_swap"] or {}
        if report["swaps"] != before + 1 or last.get("unloaded") != [second]:
            raise RuntimeError(f"{first}'s request did not evict {second}: {report}")
        if not catalog.sleep:
            return Run(boot=boot, cold=cold, evicting=evicting)

        state = residency(process.url)[second]
        if state != "asleep":
            raise RuntimeError(f"sleep mode on, but {second} was evicted to {state!r}, not asleep")
        waking = first_token_seconds(process.url, catalog.request_names[second], timeout)
        wakes = {model["id"]: model["wakes"] for model in catalog_report(process)["models"]}
        if wakes[second] != 1:
            raise RuntimeError(f"{second} answered without waking: {wakes}")
        return Run(boot=boot, cold=cold, evicting=evicting, waking=waking)
    finally:
        process.stop()


def measure(
    variants: list[Variant],
    runs: int,
    catalog: Catalog,
    timeout: float,
    progress: bool = True,
) -> list[ModeResult]:
    results = {variant: ModeResult(variant_name(variant)) for variant in variants}
    with tempfile.TemporaryDirectory(prefix="catalog-bench-") as work:
        for number in range(runs):
            for variant in variants:
                run = run_once(variant, catalog, Path(work), timeout)
                results[variant].runs.append(run)
                if progress:
                    waking = "" if run.waking is None else f", waking {run.waking:.1f} s"
                    print(
                        f"run {number + 1}/{runs} {variant_name(variant)}: boot {run.boot:.1f} s, cold first "
                        f"token {run.cold:.1f} s, while evicting {run.evicting:.1f} s{waking}",
                        file=sys.stderr,
                        flush=True,
                    )
    return list(results.values())


def _cell(result: ModeResult, name: str) -> str:
    each = ", ".join(f"{getattr(run, name):.1f}" for run in result.runs)
    return f"{result.median(name):.1f} ({each})"


def table(results: list[ModeResult]) -> str:
    """A Markdown table, each cell the median and (each run's seconds)."""
    waking = all(run.waking is not None for result in results for run in result.runs)
    head = "| mode | boot s | cold model, first token s | the same while evicting s | eviction adds s |"
    lines = [
        head + (" asleep model, first token s |" if waking else ""),
        "| --- " * (6 if waking else 5) + "|",
    ]
    for result in results:
        adds = result.median("evicting") - result.median("cold")
        lines.append(
            f"| {result.mode} | {_cell(result, 'boot')} | {_cell(result, 'cold')} | "
            f"{_cell(result, 'evicting')} | {adds:+.1f} |"
            + (f" {_cell(result, 'waking')} |" if waking else "")
        )
    return "\n".join(lines)


def conclusion(results: list[ModeResult]) -> str:
    """One line: which mode boots and answers a cold model sooner, what an eviction adds, and
    (with sleep mode) what a wake takes."""
    adds = ", ".join(
        f"{r.median('evicting') - r.median('cold'):+.1f} s ({r.mode})" for r in results
    )
    if len(results) == 1:
        only = results[0]
        line = (
            f"conclusion: {only.mode} boots in {only.median('boot'):.1f} s and answers a cold "
            f"model's first token in {only.median('cold'):.1f} s; evicting another model first "
            f"adds {adds}"
        )
    else:
        fast = min(results, key=lambda r: r.median("cold"))
        slow = max(results, key=lambda r: r.median("cold"))
        line = (
            f"conclusion: {fast.mode} answers a cold model "
            f"{slow.median('cold') - fast.median('cold'):.1f} s sooner "
            f"({fast.median('cold'):.1f} vs {slow.median('cold'):.1f} s; boot "
            f"{fast.median('boot'):.1f} vs {slow.median('boot'):.1f} s); evicting another model "
            f"first adds {adds}"
        )
    if all(run.waking is not None for result in results for run in result.runs):
        wakes = ", ".join(f"{r.median('waking'):.1f} s ({r.mode})" for r in results)
        line += f"; a model asleep answers its first token in {wakes}"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(
            "Time a two-model catalog per engine_boot_mode: boot, a cold model's first token, "
            "and the same while another model is evicted."
        )
    )
    parser.add_argument(
        "--model",
        action="append",
        help="a model directory (twice: the two models; default: the tiny demo base twice)",
    )
    parser.add_argument("--runs", type=int, default=2, help="gateways per mode (default 2)")
    parser.add_argument(
        "--mode", action="append", choices=MODES, help="only these modes (repeatable)"
    )
    parser.add_argument("--sleep", action="store_true", help="sleep: true in each catalog entry")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="stand-in engines (tools/bench/fake_engine.py), one run: a smoke run in seconds",
    )
    parser.add_argument(
        "--no-spare", action="store_true", help="leave out the gateways with a spare engine"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds one step may take")
    args = parser.parse_args(argv)
    if args.model is not None and len(args.model) != 2:
        parser.error("--model takes two models (give it twice)")
    if args.sleep and not sleep_supported():
        print(SLEEP_UNSUPPORTED, file=sys.stderr)
        return 3
    catalog = models_catalog(args.model) if args.model else demo_catalog(ensure_demo())
    catalog.stand_in = args.quick
    catalog.sleep = args.sleep
    modes = tuple(args.mode) if args.mode else MODES
    # A spare runs vLLM's own API server: the stand-in engines have none.
    spares = (False,) if args.no_spare or args.quick else (False, True)
    variants = [(mode, spare) for mode in modes for spare in spares]
    runs = 1 if args.quick else max(args.runs, 1)
    results = measure(variants, runs, catalog, args.timeout)
    engines = "stand-in engines" if args.quick else "real engines"
    sleep = ", sleep mode on" if args.sleep else ""
    print(
        f"two models, max_loaded_models 1{sleep}, {engines}, {runs} run(s) a mode, median (each):"
    )
    print(table(results))
    print(conclusion(results))
    return 0
