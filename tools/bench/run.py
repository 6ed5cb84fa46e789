"""The bench's command line and the order of its measurements.

Two parts (three with ``--fronts``), each with the same targets side by side and the
requests interleaved:

1. **engine**: the real engine. By default the bench runs ``gateway serve`` (the demo model,
   supervisor, adapter manager, zero-adapter routing: the product as shipped) with the engine
   command wrapped by ``engine_tap``, which tells the bench the engine's port and per-boot
   key, so the same requests can go to the engine directly and through nginx. With ``--url``
   it measures an engine that is already running (a GPU box, say) with ``gateway serve
   --upstream-url`` in front.
2. **proxy**: the proxy alone, in front of ``fake_engine`` (answers at once), with the gateway
   and nginx on one CPU and the client and fake engine on the other: the added latency with
   nothing else going on, and the requests per second one core of gateway sustains.
3. **fronts** (``--fronts``): the same gateway app on each HTTP front it could run on
   (``tools/bench/fronts.py``): latency, throughput, memory and four hostile-client probes.

Targets: ``direct`` (the engine itself), ``loragate``, ``nginx`` (keep-alive upstream: the
floor a reverse proxy can reach) and ``asgi-floor`` (``minimal_proxy``: a bare ASGI app with
loragate's upstream client, the floor for anything built on uvicorn and Python).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from tools.bench import load
from tools.bench.fronts import FRONTS, fronts_part, installed
from tools.bench.load import Target, Workload
from tools.bench.stats import (
    DIRECT,
    HEADER,
    GatewayCounters,
    ProcessWatch,
    Report,
    combine,
    latency_table,
    ms,
    paired_added,
    signed_ms,
    throughput_table,
)
from tools.bench.targets import (
    EngineRecord,
    GatewayServe,
    MinimalProxy,
    Nginx,
    Process,
    UpstreamGateway,
    nginx_available,
    pinned,
    write_fake_model,
)

GATEWAY, NGINX, FLOOR = "loragate", "nginx", "asgi-floor"
ZERO = "zero-adapt"
VLLM_SERVER = ["-m", "vllm.entrypoints.openai.api_server"]


@dataclass
class Options:
    url: str | None
    api_key: str | None
    model: str | None
    engine: bool
    proxy: bool
    nginx: bool
    floor: bool
    gap: float
    rounds_c1: int
    rounds: int
    concurrency: list[int]
    ttft_rounds: int
    ttft_max_tokens: int
    throughput_concurrency: list[int]
    block_seconds: float
    block_rounds: int
    stream_tokens: int
    proxy_rounds: int
    proxy_concurrency: int
    keep: bool
    fronts: list[str] = field(default_factory=list)


def parse(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="scripts/bench.py",
        description="Measure loragate side by side with the engine alone and with nginx.",
    )
    add = parser.add_argument
    add(
        "--url",
        help="Measure this running engine (e.g. http://gpu-box:8000) instead of booting the demo.",
    )
    add("--api-key", help="The --url engine's API key.")
    add("--model", help="The model to ask (default: the gateway's base model). Without --url: "
        "a base model dir or id for gateway serve.")  # fmt: skip
    add("--no-engine", action="store_true", help="Skip the real-engine part.")
    add("--no-proxy", action="store_true", help="Skip the pure-proxy part.")
    add("--no-nginx", action="store_true", help="Leave nginx out even when it is installed.")
    add("--no-floor", action="store_true", help="Leave the bare ASGI proxy (asgi-floor) out.")
    add("--quick", action="store_true", help="Few rounds: a smoke run, not a measurement.")
    add(
        "--rounds-c1",
        type=int,
        default=500,
        help="Rounds at concurrency 1 (one request per target each).",
    )
    add("--rounds", type=int, default=25, help="Rounds per worker at higher concurrency.")
    add("--concurrency", default="1,16,32", help="Latency concurrency levels.")
    add("--gap-ms", type=float, default=0.0, help="Real engine, concurrency 1: pause after each "
        "answer, so each request meets an idle engine (0: back to back).")  # fmt: skip
    add("--ttft-rounds", type=int, default=300)
    add("--ttft-max-tokens", type=int, default=8)
    add("--throughput-concurrency", default="16,32")
    add("--block-seconds", type=float, default=1.5)
    add("--block-rounds", type=int, default=10)
    add("--stream-tokens", type=int, default=32, help="max_tokens of the streamed tokens/s run.")
    add("--proxy-rounds", type=int, default=3000)
    add("--proxy-concurrency", type=int, default=32)
    add("--keep", action="store_true", help="Keep the temporary directory (logs).")
    add("--fronts", default="", help="Also serve the gateway app on these HTTP fronts side by "
        f"side ({', '.join(FRONTS)}, or all: those installed; `pip install granian hypercorn`) "
        "in front of a fake engine: the HTTP fronts part.")  # fmt: skip
    args = parser.parse_args(argv)
    options = Options(
        url=args.url,
        api_key=args.api_key,
        model=args.model,
        engine=not args.no_engine,
        proxy=not args.no_proxy,
        nginx=not args.no_nginx and nginx_available(),
        floor=not args.no_floor,
        gap=args.gap_ms / 1000,
        rounds_c1=args.rounds_c1,
        rounds=args.rounds,
        concurrency=[int(c) for c in args.concurrency.split(",")],
        ttft_rounds=args.ttft_rounds,
        ttft_max_tokens=args.ttft_max_tokens,
        throughput_concurrency=[int(c) for c in args.throughput_concurrency.split(",")],
        block_seconds=args.block_seconds,
        block_rounds=args.block_rounds,
        stream_tokens=args.stream_tokens,
        proxy_rounds=args.proxy_rounds,
        proxy_concurrency=args.proxy_concurrency,
        keep=args.keep,
        fronts=_fronts(args.fronts),
    )
    if args.quick:
        options.rounds_c1, options.rounds, options.ttft_rounds = 40, 3, 10
        options.block_seconds, options.proxy_rounds = 1.0, 300
        options.block_rounds = min(options.block_rounds, 1)
    return options


def _fronts(given: str) -> list[str]:
    if given == "all":
        return [front for front in FRONTS if installed(front)]
    fronts = [front for front in given.split(",") if front]
    for front in fronts:
        if front not in FRONTS:
            raise SystemExit(f"--fronts: unknown front {front!r} (one of {', '.join(FRONTS)})")
        if not installed(front):
            raise SystemExit(f"--fronts: {front} is not installed (pip install {front})")
    return fronts


def machine_line() -> str:
    model = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    cpus = len(os.sched_getaffinity(0))
    load1 = os.getloadavg()[0]
    return f"{cpus} CPUs ({model}), Python {platform.python_version()}, load average {load1:.2f} at start"


def engine_ids(engine: EngineRecord) -> list[str]:
    headers = {"Authorization": f"Bearer {engine.api_key}"} if engine.api_key else {}
    with engine.client() as client:
        listing = client.get(f"{engine.url}/v1/models", headers=headers).json()
    return [m["id"] for m in listing["data"]]


def engine_model_for(public: str, base: str, ids: list[str]) -> str:
    """The engine id the gateway sends ``public`` to, so "direct" asks the engine the same thing.

    Adapters are served as ``name@<version>``; on the CPU build the base model goes through
    the all-zero adapter ``__base__@<hash>``.
    """
    if public == base:
        zero = [i for i in ids if i.startswith("__base__@")]
        if zero:
            return zero[0]
    versions = [i for i in ids if i.startswith(public + "@")]
    if versions:
        return versions[-1]
    return public


# ----- part 1: the real engine ---------------------------------------------------------------


@dataclass
class Setup:
    """What one part measures: the targets, and the processes to stop afterwards."""

    gateway: GatewayServe | UpstreamGateway
    targets: list[Target]
    others: list[Process] = field(default_factory=list)
    # The engine alone, the base model asked plainly ("direct") and through the zero adapter:
    # what the CPU build's base-routing guard costs, which the targets above all pay alike.
    guard: list[Target] = field(default_factory=list)

    def stop(self) -> None:
        for process in [*self.others, self.gateway]:
            process.stop()


async def engine_part(report: Report, options: Options, workdir: Path) -> None:
    gateway: GatewayServe | UpstreamGateway
    if options.url is None:
        report.say("Booting `gateway serve` with the real engine (demo model unless --model)...")
        started = time.monotonic()
        gateway = GatewayServe(
            workdir / "engine-gateway", [sys.executable, *VLLM_SERVER], model=options.model
        )
    else:
        gateway = UpstreamGateway(workdir / "url-gateway", options.url, options.api_key)
    setup = Setup(gateway, [])
    try:
        if isinstance(gateway, GatewayServe):
            gateway.wait_ready(900)
            report.say(f"  ready after {time.monotonic() - started:.0f} s")
            engine = gateway.engine()
        else:
            gateway.wait_ready(120)
            parts = urlsplit(options.url or "")
            engine = EngineRecord(
                port=parts.port or 80,
                api_key=options.api_key,
                host=parts.hostname or "127.0.0.1",
            )
        public_ids = [
            m["id"] for m in httpx.get(gateway.url + "/v1/models", timeout=10).json()["data"]
        ]
        public = options.model if options.url is not None and options.model else public_ids[0]
        direct_model = engine_model_for(public, public_ids[0], engine_ids(engine))
        rss_idle = gateway.rss()
        setup.targets = [
            engine.target(DIRECT, direct_model),
            Target(GATEWAY, "127.0.0.1", gateway.port, public),
        ]
        if options.nginx:
            nginx = Nginx(workdir / "nginx-engine", engine.nginx_upstream())
            setup.others.append(nginx)
            nginx.wait_ready()
            setup.targets.append(
                Target(NGINX, "127.0.0.1", nginx.port, direct_model, engine.api_key)
            )
        throughput_targets = list(setup.targets)
        if direct_model.startswith("__base__@"):
            setup.guard = [engine.target(DIRECT, public), engine.target(ZERO, direct_model)]
        if options.floor:
            floor = MinimalProxy(workdir / "floor-engine", engine)
            setup.others.append(floor)
            floor.wait_ready()
            setup.targets.append(Target(FLOOR, "127.0.0.1", floor.port, direct_model))
        report.say(
            f"  model {public!r} (engine id {direct_model!r}); targets: "
            + ", ".join(f"{t.name} {t.uds or f':{t.port}'}" for t in setup.targets)
        )
        await measure_engine(report, options, setup, throughput_targets, rss_idle)
    finally:
        setup.stop()


async def measure_engine(
    report: Report, options: Options, setup: Setup, throughput_targets: list[Target], rss_idle: int
) -> None:
    targets, gateway = setup.targets, setup.gateway
    short = Workload(max_tokens=1)
    await load.interleaved(targets, short, 1, 10)  # warm-up: connections, caches, engine paths
    await load.interleaved(targets, short, 8, 3)
    overhead = GatewayCounters(gateway.url)

    report.say("")
    report.say(
        "Latency, non-streaming chat, max_tokens=1, interleaved (ms; + = added to direct; "
        f"{options.gap * 1000:g} ms pause between requests at concurrency 1)"
    )
    report.say(HEADER)
    for concurrency in options.concurrency:
        rounds = options.rounds_c1 if concurrency == 1 else options.rounds
        gap = options.gap if concurrency == 1 else 0.0
        overhead.start()
        samples = await load.interleaved(targets, short, concurrency, rounds, gap)
        summaries = latency_table(report, samples, concurrency)
        own = overhead.mean()
        report.say(
            f"        loragate's own account of its time per request (/metrics): {ms(own)} ms"
        )
        if concurrency != 1:
            continue
        paired = {name: paired_added(samples, name) for name in summaries if name != DIRECT}
        report.say(
            "        paired median added: "
            + ", ".join(f"{n} {signed_ms(v)}" for n, v in paired.items())
        )
        added = summaries[GATEWAY].p50 - summaries[DIRECT].p50
        if NGINX in summaries:
            nginx_added = summaries[NGINX].p50 - summaries[DIRECT].p50
            report.goal(
                added <= nginx_added + 0.00025,
                f"engine, c=1: median added {added * 1000:.2f} ms vs nginx {nginx_added * 1000:.2f} ms "
                f"(goal: at most nginx + 0.25 ms; {(added - nginx_added) * 1000:+.2f} ms)",
            )
        p99_added = summaries[GATEWAY].p99 - summaries[DIRECT].p99
        report.goal(
            p99_added <= 0.002, f"engine, c=1: p99 added {p99_added * 1000:.2f} ms (goal <= 2 ms)"
        )

    report.say("")
    report.say(
        f"Time to first token, streaming chat, max_tokens={options.ttft_max_tokens}, "
        f"concurrency 1, {options.gap * 1000:g} ms pause between requests (ms)"
    )
    report.say(HEADER)
    streamed = Workload(max_tokens=options.ttft_max_tokens, stream=True)
    samples = await load.interleaved(targets, streamed, 1, options.ttft_rounds, options.gap)
    ttft = latency_table(report, samples, 1, pick="ttft")
    report.say(
        "        paired median added: "
        + ", ".join(
            f"{name} {signed_ms(paired_added(samples, name, 'ttft'))}"
            for name in ttft
            if name != DIRECT
        )
    )
    ttft_added = ttft[GATEWAY].p50 - ttft[DIRECT].p50
    report.goal(
        ttft_added <= 0.001, f"engine: median added TTFT {ttft_added * 1000:.2f} ms (goal <= 1 ms)"
    )

    if setup.guard:
        report.say("")
        report.say(
            "What the base-routing guard costs (CPU build): the engine alone, the base model "
            "asked plainly (direct) and through the all-zero adapter every target above uses, "
            "max_tokens=1, concurrency 1 (ms)"
        )
        report.say(HEADER)
        rounds = max(options.rounds_c1 // 2, 10)
        latency_table(report, await load.interleaved(setup.guard, short, 1, rounds), 1)

    report.say("")
    if options.block_rounds < 1:
        report.say("Throughput: skipped (--block-rounds 0).")
        report.goal(
            rss_idle <= 120 * 2**20, f"loragate RSS idle {rss_idle / 2**20:.1f} MB (goal <= 120 MB)"
        )
        return
    report.say(
        f"Throughput, non-streaming chat, max_tokens=1, {options.block_rounds} rounds of "
        f"{options.block_seconds:g} s blocks per target, rotating (x = fraction of direct)"
    )
    watches = [ProcessWatch(gateway, GATEWAY)]
    watches += [ProcessWatch(p, NGINX) for p in setup.others if isinstance(p, Nginx)]
    before, after = combine(*watches)
    for concurrency in options.throughput_concurrency:
        results = await load.blocks(
            throughput_targets, short, concurrency, options.block_seconds, options.block_rounds,
            before, after,
        )  # fmt: skip
        for watch in watches:
            watch.count(results)
        ratios = throughput_table(report, results, concurrency, "tok")
        report.goal(
            ratios[GATEWAY] >= 0.97,
            f"engine, c={concurrency}: throughput x{ratios[GATEWAY]:.3f} of direct (goal >= 0.97)"
            + (f"; nginx x{ratios[NGINX]:.3f}" if NGINX in ratios else ""),
        )
    stream_c = options.throughput_concurrency[0]
    report.say(
        f"  streamed, max_tokens={options.stream_tokens}, concurrency {stream_c} (tokens counted from events):"
    )
    results = await load.blocks(
        throughput_targets, Workload(max_tokens=options.stream_tokens, stream=True), stream_c,
        options.block_seconds, options.block_rounds, before, after,
    )  # fmt: skip
    for watch in watches:
        watch.count(results)
    throughput_table(report, results, stream_c, "tok")

    report.say("")
    report.say(
        f"loragate process: RSS {rss_idle / 2**20:.1f} MB idle after boot, peak "
        f"{watches[0].peak_rss / 2**20:.1f} MB under load, {gateway.rss() / 2**20:.1f} MB after; "
        f"CPU {watches[0].cpu_ms_per_1000():.0f} ms per 1000 requests (throughput blocks)"
    )
    for watch in watches[1:]:
        report.say(
            f"nginx (master + worker): RSS {watch.process.rss() / 2**20:.1f} MB, "
            f"CPU {watch.cpu_ms_per_1000():.0f} ms per 1000 requests"
        )
    report.goal(
        rss_idle <= 120 * 2**20, f"loragate RSS idle {rss_idle / 2**20:.1f} MB (goal <= 120 MB)"
    )


# ----- part 2: the proxy alone ---------------------------------------------------------------


async def proxy_part(report: Report, options: Options, workdir: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    proxy_cpus = {cpus[-1]} if len(cpus) > 1 else None
    client_cpus = set(cpus[:-1]) if len(cpus) > 1 else None
    model_dir = write_fake_model(workdir / "fake-model")
    gateway = GatewayServe(
        workdir / "proxy-gateway", [sys.executable, "-m", "tools.bench.fake_engine"],
        model=str(model_dir), cpus=proxy_cpus, engine_cpus=client_cpus,
    )  # fmt: skip
    setup = Setup(gateway, [])
    try:
        gateway.wait_ready(120)
        record = gateway.engine()
        public = gateway.models()[0]
        direct_model = engine_model_for(public, public, engine_ids(record))
        setup.targets = [
            record.target(DIRECT, direct_model),
            Target(GATEWAY, "127.0.0.1", gateway.port, public),
        ]
        if options.nginx:
            nginx = Nginx(workdir / "nginx-proxy", record.nginx_upstream(), cpus=proxy_cpus)
            setup.others.append(nginx)
            nginx.wait_ready()
            setup.targets.append(
                Target(NGINX, "127.0.0.1", nginx.port, direct_model, record.api_key)
            )
        if options.floor:
            floor = MinimalProxy(workdir / "floor-proxy", record, cpus=proxy_cpus)
            setup.others.append(floor)
            floor.wait_ready()
            setup.targets.append(Target(FLOOR, "127.0.0.1", floor.port, direct_model))
        rss_idle = gateway.rss()
        where = (
            f"loragate, nginx and asgi-floor on CPU {sorted(proxy_cpus)}, client and fake engine on "
            f"CPU {sorted(client_cpus or [])}"
            if proxy_cpus
            else "one CPU: no pinning"
        )
        report.say("")
        report.say(
            f"Pure proxy cost: instant fake upstream (tools.bench.fake_engine behind `gateway serve`); {where}"
        )
        with pinned(client_cpus):
            await measure_proxy(report, options, setup, rss_idle)
    finally:
        setup.stop()


async def measure_proxy(report: Report, options: Options, setup: Setup, rss_idle: int) -> None:
    targets, gateway = setup.targets, setup.gateway
    short = Workload(max_tokens=1)
    await load.interleaved(targets, short, 1, 200)
    overhead = GatewayCounters(gateway.url)
    overhead.start()
    samples = await load.interleaved(targets, short, 1, options.proxy_rounds)
    report.say(HEADER)
    summaries = latency_table(report, samples, 1)
    report.say(
        "        paired median added: "
        + ", ".join(f"{n} {signed_ms(paired_added(samples, n))}" for n in summaries if n != DIRECT)
    )
    report.say(
        f"        loragate's own account of its time per request (/metrics): {ms(overhead.mean())} ms"
    )
    streamed = Workload(max_tokens=16, stream=True)
    samples = await load.interleaved(targets, streamed, 1, options.proxy_rounds // 3)
    report.say("  streamed (max_tokens=16), time to first token:")
    latency_table(report, samples, 1, pick="ttft")
    watches = [ProcessWatch(p, n) for p, n in [(gateway, GATEWAY)]]
    watches += [ProcessWatch(p, NGINX if isinstance(p, Nginx) else FLOOR) for p in setup.others]
    before, after = combine(*watches)
    counters = GatewayCounters(gateway.url)
    counters.start()
    report.say(
        f"  saturated, concurrency {options.proxy_concurrency} ({options.block_rounds} x "
        f"{options.block_seconds:g} s blocks):"
    )
    results = await load.blocks(
        targets,
        short,
        options.proxy_concurrency,
        options.block_seconds,
        options.block_rounds,
        before,
        after,
    )
    for watch in watches:
        watch.count(results)
    throughput_table(report, results, options.proxy_concurrency, "tok")
    for watch in watches:
        per_request = watch.cpu_ms_per_1000()
        per_core = 1e6 / per_request if per_request else math.nan
        report.say(
            f"  {watch.target}: {per_request:.0f} ms CPU per 1000 requests (= {per_core:.0f} req/s "
            f"per core at 100% CPU); RSS {watch.process.rss() / 2**20:.1f} MB"
            + (f" ({rss_idle / 2**20:.1f} MB idle)" if watch.target == GATEWAY else "")
        )
    young = counters.young_collections() * 1000
    report.say(f"  loragate: {young:.1f} young-generation garbage collections per 1000 requests")


# ----- entry point ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    options = parse(argv)
    report = Report()
    report.say(f"loragate bench: {machine_line()}")
    report.say(
        f"command: {' '.join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)])}"
    )
    if not options.nginx:
        report.say(
            "nginx: not installed (apt-get install nginx-light) or --no-nginx: no reference floor"
        )
    workdir = Path(tempfile.mkdtemp(prefix="loragate-bench-"))
    try:
        if options.engine:
            _run(engine_part(report, options, workdir))
        if options.proxy:
            _run(proxy_part(report, options, workdir))
        if options.fronts:
            _run(fronts_part(report, options, workdir, options.fronts))
    finally:
        if options.keep:
            report.say(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    report.finish()
    return 0


def _run(part: Coroutine[None, None, None]) -> None:
    """Run on uvloop where installed, so the client costs as little as it can."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(part)
    else:
        uvloop.run(part)
