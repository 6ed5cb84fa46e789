"""The HTTP fronts the gateway could run on, side by side: the bench's ``--fronts`` part.

The same gateway (``gateway serve --upstream-url``'s app, in front of ``fake_engine`` on TCP)
served four ways, each on one CPU with the client and the fake engine on the other:

- ``loragate``: ``gateway serve --upstream-url`` itself, on loragate's own server;
- ``uvicorn``: the app under uvicorn through its public ``Config`` (httptools, uvloop);
- ``granian``: under Granian's ASGI interface (one worker, HTTP/1, uvloop);
- ``hypercorn``: under Hypercorn on uvloop.

Each gets the closest settings its public options offer to loragate's limits (header
deadline, body deadline, header cap, concurrency cap). The part measures added latency at
concurrency 1, throughput at concurrency 16, idle RSS and CPU per request, then probes four
guarantees from outside (a slow header, a 1 MiB header, a stalled body, a trickling body)
and prints what each front did.

    LORAGATE_BENCH_FRONT_UPSTREAM=URL LORAGATE_BENCH_FRONT_PORT=P python -m tools.bench.fronts uvicorn
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.bench import load
from tools.bench.load import Target, Workload
from tools.bench.stats import (
    DIRECT,
    HEADER,
    ProcessWatch,
    Report,
    combine,
    latency_table,
    paired_added,
    signed_ms,
    throughput_table,
)
from tools.bench.targets import (
    Nginx,
    Process,
    ProcessTree,
    UpstreamGateway,
    free_port,
    pinned,
    wait_listening,
)

FRONTS = ("loragate", "uvicorn", "granian", "hypercorn")
UPSTREAM_ENV = "LORAGATE_BENCH_FRONT_UPSTREAM"
PORT_ENV = "LORAGATE_BENCH_FRONT_PORT"
MODEL = "bench-model"
# Short limits, the same for every front that has the option, so the probes end in seconds.
LIMITS: dict[str, Any] = {"header_timeout": 3.0, "body_timeout": 3.0, "body_deadline": 6.0}
PROBE_WAIT = 10.0  # a probe that sees nothing by then: the front holds the connection


def installed(front: str) -> bool:
    return front == "loragate" or importlib.util.find_spec(front) is not None


# ----- the fronts, in their own process ------------------------------------------------------


def _gateway() -> tuple[Any, Any]:
    from loragate.gateway.app import create_app
    from loragate.logs import configure_logging
    from loragate.settings import load_settings

    settings = load_settings(
        None,
        upstream_url=os.environ[UPSTREAM_ENV],
        port=int(os.environ[PORT_ENV]),
        log_level="warning",
        **LIMITS,
    )
    configure_logging(settings.log_level, settings.log_json)
    app = create_app(settings)
    gc.collect()
    gc.freeze()  # as `gateway serve` does
    return settings, app


def granian_app() -> Any:
    """Granian imports its target in its worker: this factory builds the app there."""
    return _gateway()[1]


def serve(front: str) -> None:
    port = int(os.environ[PORT_ENV])
    if front == "granian":
        from granian import Granian
        from granian.constants import HTTPModes, Interfaces, Loops
        from granian.http import HTTP1Settings
        from granian.log import LogLevels

        settings = _gateway()[0]  # only for the limits: the worker builds its own app
        Granian(
            "tools.bench.fronts:granian_app",
            factory=True,
            address="127.0.0.1",
            port=port,
            interface=Interfaces.ASGI,
            workers=1,
            loop=Loops.uvloop,
            http=HTTPModes.http1,
            http1_settings=HTTP1Settings(
                header_read_timeout=int(settings.header_timeout * 1000),
                max_buffer_size=settings.max_header_bytes,
            ),
            backpressure=settings.limit_concurrency,
            log_level=LogLevels.warning,
        ).serve()
        return
    settings, app = _gateway()
    if front == "uvicorn":
        import uvicorn

        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            loop="uvloop",
            http="httptools",
            limit_concurrency=settings.limit_concurrency,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=int(settings.drain_timeout),
            log_level="warning",
            access_log=False,
        )
        uvicorn.Server(config).run()
    elif front == "hypercorn":
        import uvloop
        from hypercorn.asyncio import serve as hypercorn_serve
        from hypercorn.config import Config

        hyper = Config()
        hyper.bind = [f"127.0.0.1:{port}"]
        hyper.keep_alive_timeout = 30
        hyper.read_timeout = int(settings.body_timeout)
        hyper.h11_max_incomplete_size = settings.max_header_bytes
        hyper.graceful_timeout = settings.drain_timeout
        hyper.loglevel = "WARNING"
        uvloop.run(hypercorn_serve(app, hyper))
    else:
        raise SystemExit(f"unknown front {front!r}")


class Front(ProcessTree):
    """The gateway under one front (``loragate`` is ``gateway serve`` itself); Granian's
    serves from a worker process, measured with it."""

    def __init__(
        self, front: str, workdir: Path, upstream: str, api_key: str, cpus: set[int] | None
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.front = front
        self.port = free_port()
        argv = [sys.executable, "-m", "tools.bench.fronts", front]
        env = {
            UPSTREAM_ENV: upstream,
            PORT_ENV: str(self.port),
            "LORAGATE_UPSTREAM_API_KEY": api_key,
            "LORAGATE_CACHE_DIR": str(workdir / "cache"),
        }
        super().__init__(front, argv, workdir / f"{front}.log", env=env, cpus=cpus)

    def wait_ready(self, timeout: float = 60) -> None:
        wait_listening(self, self.port, timeout)


# ----- the probes ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """What one hostile client sends; ``then`` is sent a byte a second after ``head``."""

    name: str
    head: bytes
    then: bytes = b""


def _request_head(extra: bytes = b"", length: int = 100) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + extra
        + b"Content-Length: %d\r\n\r\n" % length
    )


PROBES = (
    Probe("slow header", b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"),
    Probe("1 MiB header", _request_head(b"X-Big: " + b"a" * 2**20 + b"\r\n", 2) + b"{}"),
    Probe("stalled body", _request_head() + b'{"model": '),
    Probe("trickled body", _request_head(), b" " * 99),
)


async def probe(port: int, what: Probe) -> str:
    """What the front did: its status line and when, or when it closed, or nothing."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def trickle() -> None:
        with contextlib.suppress(OSError):
            writer.write(what.head)
            for byte in what.then:
                await asyncio.sleep(1)
                writer.write(bytes([byte]))
                await writer.drain()

    sender = asyncio.create_task(trickle())
    try:
        line = await asyncio.wait_for(reader.readline(), PROBE_WAIT)
    except TimeoutError:
        return f"still open after {PROBE_WAIT:g} s"
    except OSError as exc:
        return f"reset after {time.monotonic() - started:.1f} s ({exc.__class__.__name__})"
    finally:
        sender.cancel()
        writer.close()
    after = time.monotonic() - started
    if not line:
        return f"closed after {after:.1f} s"
    status = line.decode("latin-1").split(" ", 2)[1:2]
    return f"{status[0] if status else '?'} after {after:.1f} s"


# ----- the part ------------------------------------------------------------------------------


async def fronts_part(report: Report, options: Any, workdir: Path, fronts: list[str]) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    front_cpus = {cpus[-1]} if len(cpus) > 1 else None
    client_cpus = set(cpus[:-1]) if len(cpus) > 1 else None
    key = "bench-front-key"
    engine_port = free_port()
    engine = Process(
        "fake engine",
        [sys.executable, "-m", "tools.bench.fake_engine", "--port", str(engine_port),
         "--api-key", key, "--served-model-name", MODEL],
        workdir / "fake-engine.log",
        cpus=client_cpus,
    )  # fmt: skip
    upstream = f"http://127.0.0.1:{engine_port}/v1"
    processes: list[Process] = [engine]
    servers: dict[str, UpstreamGateway | Front] = {}
    try:
        wait_listening(engine, engine_port, 30)
        for front in fronts:
            if front == "loragate":
                server: UpstreamGateway | Front = UpstreamGateway(
                    workdir / "front-loragate", upstream, key, cpus=front_cpus,
                    extra_args=[f"--{name.replace('_', '-')}={value:g}" for name, value in LIMITS.items()],
                )  # fmt: skip
            else:
                server = Front(front, workdir / f"front-{front}", upstream, key, front_cpus)
            processes.append(server)
            servers[front] = server
        targets = [Target(DIRECT, "127.0.0.1", engine_port, MODEL, key)]
        for front, server in servers.items():
            wait_listening(server, server.port, 60)
            targets.append(Target(front, "127.0.0.1", server.port, MODEL))
        if options.nginx:
            nginx = Nginx(workdir / "nginx-fronts", f"127.0.0.1:{engine_port}", cpus=front_cpus)
            processes.append(nginx)
            nginx.wait_ready()
            targets.append(Target("nginx", "127.0.0.1", nginx.port, MODEL, key))
        report.say("")
        report.say(
            "HTTP fronts: the same gateway app (--upstream-url) on each front, in front of "
            f"tools.bench.fake_engine on TCP; fronts on CPU {sorted(front_cpus or [])}, client "
            f"and fake engine on CPU {sorted(client_cpus or [])}"
        )
        started = {front: server.rss() for front, server in servers.items()}
        short = Workload(max_tokens=1)
        await load.interleaved(targets, short, 1, 200)
        warm = {front: server.rss() for front, server in servers.items()}
        with pinned(client_cpus):
            await _measure(report, options, targets, servers)
        report.say("  idle RSS (MB), after start / after 200 requests / after the load:")
        for front, server in servers.items():
            report.say(
                f"    {front:<10} {started[front] / 2**20:7.1f} {warm[front] / 2**20:7.1f} "
                f"{server.rss() / 2**20:7.1f}"
            )
        report.say(
            "  guarantees probed from outside (limits: "
            + ", ".join(f"{name} {value:g} s" for name, value in LIMITS.items())
            + "; what each front answered, and when):"
        )
        report.say(f"    {'':<10} " + "".join(f"{p.name:<24}" for p in PROBES))
        for front, server in servers.items():
            results = await asyncio.gather(*(probe(server.port, p) for p in PROBES))
            report.say(f"    {front:<10} " + "".join(f"{r:<24}" for r in results))
    finally:
        for process in reversed(processes):
            process.stop()


async def _measure(
    report: Report, options: Any, targets: list[Target], servers: dict[str, UpstreamGateway | Front]
) -> None:
    short = Workload(max_tokens=1)
    samples = await load.interleaved(targets, short, 1, options.proxy_rounds)
    report.say("  latency, non-streaming chat, concurrency 1 (ms):")
    report.say(HEADER)
    summaries = latency_table(report, samples, 1)
    report.say(
        "        paired median added: "
        + ", ".join(f"{n} {signed_ms(paired_added(samples, n))}" for n in summaries if n != DIRECT)
    )
    streamed = Workload(max_tokens=16, stream=True)
    samples = await load.interleaved(targets, streamed, 1, options.proxy_rounds // 3)
    report.say("  streamed (max_tokens=16), time to first token:")
    latency_table(report, samples, 1, pick="ttft")
    watches = [ProcessWatch(server, front) for front, server in servers.items()]
    before, after = combine(*watches)
    concurrency = 16
    report.say(
        f"  throughput, concurrency {concurrency} ({options.block_rounds} x "
        f"{options.block_seconds:g} s blocks per target):"
    )
    results = await load.blocks(
        targets, short, concurrency, options.block_seconds, options.block_rounds, before, after
    )
    for watch in watches:
        watch.count(results)
    throughput_table(report, results, concurrency, "tok")
    for watch in watches:
        per_request = watch.cpu_ms_per_1000()
        per_core = 1e6 / per_request if per_request else math.nan
        report.say(
            f"  {watch.target}: {per_request:.0f} ms CPU per 1000 requests "
            f"(= {per_core:.0f} req/s per core)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve the gateway on one HTTP front.")
    parser.add_argument("front", choices=[f for f in FRONTS if f != "loragate"])
    serve(parser.parse_args().front)


if __name__ == "__main__":
    main()
