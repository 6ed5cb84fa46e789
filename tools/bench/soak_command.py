"""``scripts/soak.py``: start a gateway on the tiny demo (or take ``--url``) and soak it.

A ``--url`` gateway with an admin key must read the demo's adapter directories, which the
swaps send as local sources: start it with ``--adapter-source-root`` naming the demo's
directory (``gateway serve --help``), as the gateway started here is."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loragate.demo.layout import demo_adapter_dir, ensure_demo
from tools.bench.attackers import AttackPlan
from tools.bench.soak import Soak, SoakPlan, pid_listening_on

# ----- the command line -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


BODY_DEADLINE = 10.0  # the gateway it starts: a trickled body is cut within a short soak


def _start_gateway(
    cache_dir: Path, admin_key: str, log_path: Path, demo: Path
) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    gateway = Path(sys.executable).parent / "gateway"
    argv = [str(gateway), "demo", "--port", str(port), "--cache-dir", str(cache_dir)]
    argv += ["--body-deadline", str(BODY_DEADLINE)]  # the trickle-body attackers' bound
    # The swaps send the demo's adapter directories over the admin API, as local paths.
    argv += ["--adapter-source-root", str(demo)]
    # The tiny demo: its adapters answer fixed words, which is how the soak judges routing.
    env = {
        **os.environ,
        "LORAGATE_ADMIN_KEY": admin_key,
        "LORAGATE_DEMO": "tiny",
        "PYTHONUNBUFFERED": "1",
    }
    with log_path.open("ab") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    return process, f"http://127.0.0.1:{port}"


def _wait_ready(url: str, process: subprocess.Popen[bytes] | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the gateway exited with {process.returncode} while starting")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(1)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout:g} s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="soak",
        description="Mixed streaming/plain load with adapter swaps and one engine kill; "
        "reports lost requests and the gateway's memory and descriptors.",
    )
    parser.add_argument("--url", help="a running gateway (default: start one on the demo)")
    parser.add_argument("--admin-key", default=os.environ.get("LORAGATE_ADMIN_KEY"))
    parser.add_argument("--duration", type=float, default=150.0, help="seconds of load [150]")
    parser.add_argument("--concurrency", type=int, default=4, help="concurrent clients [4]")
    parser.add_argument("--swap-every", type=float, default=10.0, help="seconds between swaps [10]")
    parser.add_argument("--kill-at", type=float, default=0.5, help="fraction of the run [0.5]")
    parser.add_argument("--no-kill", action="store_true", help="do not kill the engine")
    parser.add_argument(
        "--hostile-every", type=float, default=2.0, help="seconds between hostile requests [2]"
    )
    parser.add_argument("--no-hostile", action="store_true", help="send no hostile requests")
    parser.add_argument(
        "--has-media-dir",
        action="store_true",
        help="the --url gateway has an --allowed-media-dir (local files are refused with a 403 "
        "there, not a 400)",
    )
    parser.add_argument(
        "--idle-sockets", type=int, default=128, help="idle attacker sockets held at once [128]"
    )
    parser.add_argument(
        "--slow-headers", type=int, default=4, help="slow-header attacker sockets [4]"
    )
    parser.add_argument(
        "--head-deadline",
        type=float,
        default=20.0,
        help="seconds within which the gateway must close an attacker's socket [20]",
    )
    parser.add_argument(
        "--trickle-bodies", type=int, default=4, help="trickle-body attacker sockets [4]"
    )
    parser.add_argument(
        "--body-deadline",
        type=float,
        default=2 * BODY_DEADLINE,
        help="seconds within which the gateway must close a trickle-body socket "
        f"[{2 * BODY_DEADLINE:g}; the gateway it starts has --body-deadline {BODY_DEADLINE:g}]",
    )
    parser.add_argument(
        "--no-attack", action="store_true", help="no attacker sockets, wide or departing clients"
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--cache-dir", type=Path, help="for the gateway it starts [a temp dir]")
    parser.add_argument("--json", type=Path, help="also write the full result here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    demo = ensure_demo()
    sources = (str(demo_adapter_dir(demo, "pong")), str(demo_adapter_dir(demo, "fox")))
    process: subprocess.Popen[bytes] | None = None
    workdir = Path(tempfile.mkdtemp(prefix="loragate-soak-"))
    try:
        if args.url:
            url, admin_key = args.url.rstrip("/"), args.admin_key
            pid = pid_listening_on(httpx.URL(url).port or 80)
        else:
            admin_key = args.admin_key or secrets.token_urlsafe(16)
            cache_dir = args.cache_dir or workdir / "cache"
            process, url = _start_gateway(cache_dir, admin_key, workdir / "gateway.log", demo)
            pid = process.pid
            print(
                f"started gateway pid {pid} at {url} (log: {workdir / 'gateway.log'})", flush=True
            )
        _wait_ready(url, process, timeout=900)
        plan = SoakPlan(
            url=url,
            admin_key=admin_key,
            duration_s=args.duration,
            concurrency=args.concurrency,
            swap_every_s=args.swap_every,
            kill_at=None if args.no_kill else args.kill_at,
            max_tokens=args.max_tokens,
            gateway_pid=pid,
            swap_sources=sources,
            hostile_every_s=None if args.no_hostile else args.hostile_every,
            media_dir=bool(args.url) and args.has_media_dir,
            attack=None
            if args.no_attack
            else AttackPlan(
                host=httpx.URL(url).host,
                port=httpx.URL(url).port or 80,
                idle=args.idle_sockets,
                slow_headers=args.slow_headers,
                head_deadline_s=args.head_deadline,
                trickle_bodies=args.trickle_bodies,
                body_deadline_s=args.body_deadline,
                # The gateway reads and checks the whole 2 MB body, then finds no such model:
                # its own cost, with no engine time in it.
                wide_model="soak-no-such-model",
                departing=True,
                metrics_key=admin_key,
            ),
        )
        print(f"soaking {url} for {args.duration:g} s ...", flush=True)
        result = asyncio.run(Soak(plan).run())
    finally:
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        # The gateway's log stays for a look; the adapter store it made does not.
        shutil.rmtree(workdir / "cache", ignore_errors=True)
    print(result.report())
    if args.json:
        args.json.write_text(json.dumps(result.to_json(), indent=2))
    if result.problems() and process is not None:
        # What the gateway's supervisor said, for a failure seen only in someone's CI log.
        log = (workdir / "gateway.log").read_text(errors="replace").splitlines()
        said = [line for line in log if "loragate.supervisor" in line or "Traceback" in line]
        print("the gateway's supervisor said:", *said[-40:], sep="\n  ")
    return 0 if not result.problems() else 1
