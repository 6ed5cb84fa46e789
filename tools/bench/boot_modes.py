"""``scripts/boot_modes.py``: how long one engine boot takes in each ``engine_boot_mode``.

Each boot is the engine alone, spawned with the command line and environment that loragate
gives it (``supervisor.command``: the same argv, the same per-boot key, the mode applied) and
timed from spawn to the first 200 from ``/health`` on its socket. Then its process tree is
counted and weighed, one greedy completion is asked (the same prompt in every mode, so that a
mode that answers differently shows), and the tree is stopped as the supervisor stops it. The
modes take turns, so a busy machine's slow spell falls on each of them alike.

Each mode is also booted by a spare engine (``loragate.supervisor.spare``, the gateway's own
code): the spare is spawned and left to import vLLM until it is idle, and the boot is timed
from the order it is handed to ``/health``, which is what a catalog's cold model waits once a
spare is ready. Its tree counts the launcher the spare runs under (a boot the gateway spawns
has one too; the plain boots here run without it). ``--no-spare`` leaves these out.

    .venv/bin/python scripts/boot_modes.py                  # the tiny demo base, 2 boots a mode
    .venv/bin/python scripts/boot_modes.py --runs 3 --model DIR -- --dtype float32
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, get_args

import httpx
import psutil

from loragate.demo.layout import demo_base_dir, ensure_demo
from loragate.settings.engine import EngineBootMode
from loragate.supervisor.command import EngineSpec, engine_argv, engine_env, is_cpu_build
from loragate.supervisor.process import stop_tree
from loragate.supervisor.spare import SPARE_MODULE, SpareEngines

MODES: tuple[EngineBootMode, ...] = get_args(EngineBootMode)
# A boot mode, and whether a spare engine (loragate.supervisor.spare) takes the boot.
Variant = tuple[EngineBootMode, bool]
SERVED_NAME = "boot-modes"
PROMPT = "The capital of France is"
ANSWER_TOKENS = 32
# The answer's time is the median of these many after a first one (which warms up the engine).
TIMED_ANSWERS = 3
# The engine's KV cache on the CPU build, as the engine notes measured it: small and fixed, so
# the boot does not size it from the machine's free memory.
CPU_KV_CACHE_GIB = "1"


@dataclass
class Boot:
    """One boot: seconds from spawn to /health, its processes, their memory, its answer."""

    mode: str
    seconds: float
    processes: list[str]
    rss_bytes: int
    answer: str
    answer_seconds: float


@dataclass
class ModeResult:
    mode: str
    boots: list[Boot] = field(default_factory=list)

    @property
    def median_seconds(self) -> float:
        return statistics.median(boot.seconds for boot in self.boots)


def engine_spec(
    mode: EngineBootMode, model: str, socket_path: Path, extra_args: list[str], cpu: bool
) -> EngineSpec:
    return EngineSpec(
        model=model,
        served_name=SERVED_NAME,
        socket_path=socket_path,
        api_key=secrets.token_urlsafe(16),
        max_loras=1,
        max_lora_rank=8,
        boot_mode=mode,
        extra_args=extra_args,
        env={"VLLM_CPU_KVCACHE_SPACE": CPU_KV_CACHE_GIB} if cpu else {},
    )


def tree_of(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    return []


def process_name(proc: psutil.Process) -> str:
    """vLLM renames its engine core and workers (setproctitle); the API server is python."""
    with contextlib.suppress(psutil.Error):
        title = " ".join(proc.cmdline()) or proc.name()
        if "loragate.supervisor.launcher" in title:
            return "launcher"
        if "vllm.entrypoints" in title or SPARE_MODULE in title:
            return "api_server"
        if "multiprocessing.resource_tracker" in title:
            return "resource_tracker"
        return title.split()[0].rsplit("/", 1)[-1]
    return "?"


def ask(client: httpx.Client, headers: dict[str, str]) -> tuple[str, float]:
    """The greedy answer to ``PROMPT`` and how long it took."""
    asked = time.monotonic()
    reply = client.post(
        "/v1/completions",
        headers=headers,
        timeout=300,
        json={
            "model": SERVED_NAME,
            "prompt": PROMPT,
            "max_tokens": ANSWER_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    reply.raise_for_status()
    return str(reply.json()["choices"][0]["text"]), time.monotonic() - asked


def wait_idle(pid: int, timeout: float) -> float:
    """Wait until process ``pid``'s tree has used no CPU for a second and a half (a spare
    done importing); the seconds it took."""
    began = time.monotonic()
    last, still_since = -1.0, time.monotonic()
    while time.monotonic() - began < timeout:
        used = 0.0
        for member in tree_of(pid):
            with contextlib.suppress(psutil.Error):
                times = member.cpu_times()
                used += times.user + times.system
        if used - last > 0.05:
            last, still_since = used, time.monotonic()
        elif time.monotonic() - still_since > 1.5:
            break
        time.sleep(0.25)
    return time.monotonic() - began


def boot_once(
    variant: Variant,
    model: str,
    extra_args: list[str],
    cpu: bool,
    work_dir: Path,
    timeout: float,
) -> Boot:
    mode, spare = variant
    label = variant_name(variant)
    socket_path = work_dir / f"engine-{secrets.token_hex(4)}.sock"
    spec = engine_spec(mode, model, socket_path, extra_args, cpu)
    argv, env = engine_argv(spec), engine_env(spec)
    log_path = work_dir / f"{mode}{'-spare' if spare else ''}.log"
    headers = {"Authorization": f"Bearer {spec.api_key}"}
    client = httpx.Client(
        transport=httpx.HTTPTransport(uds=str(socket_path)), base_url="http://engine", timeout=5
    )
    proc: subprocess.Popen[bytes]
    if spare:
        # The gateway's own spare, made ready beforehand: the boot is timed from the order.
        spares = SpareEngines(work_dir, python=sys.executable, grace=30)
        spares.replenish(dict(env))
        waiting = spares.waiting
        assert waiting is not None
        wait_idle(waiting.proc.pid, timeout)
        started = time.monotonic()
        taken = spares.take(argv, env)
        if taken is None:
            raise RuntimeError(f"{label}: the spare did not take the boot")
        proc = taken.proc
        assert proc.stdout is not None
        threading.Thread(target=copy_to, args=(proc.stdout, log_path), daemon=True).start()
    else:
        started = time.monotonic()
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{label}: the engine exited with {proc.returncode}; see {log_path}"
                )
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"{label}: no /health within {timeout:g} s; see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get("/health", headers=headers).status_code == 200:
                    break
            time.sleep(0.1)
        seconds = time.monotonic() - started
        tree = tree_of(proc.pid)
        rss = 0
        for member in tree:
            with contextlib.suppress(psutil.Error):
                rss += member.memory_info().rss
        answer, _ = ask(client, headers)
        timed = [ask(client, headers)[1] for _ in range(TIMED_ANSWERS)]
        return Boot(
            mode=label,
            seconds=seconds,
            processes=[process_name(member) for member in tree],
            rss_bytes=rss,
            answer=answer,
            answer_seconds=statistics.median(timed),
        )
    finally:
        client.close()
        stop_tree(proc.pid, 30)
        proc.wait(10)


def copy_to(stream: IO[bytes], path: Path) -> None:
    with path.open("ab") as log:
        for line in stream:
            log.write(line)


def variant_name(variant: Variant) -> str:
    mode, spare = variant
    return f"{mode} + spare" if spare else mode


def measure(
    variants: list[Variant],
    runs: int,
    model: str,
    extra_args: list[str],
    timeout: float,
    progress: bool = True,
) -> list[ModeResult]:
    """``runs`` boots of each variant (a mode, with or without a spare), taking turns."""
    cpu = is_cpu_build(sys.executable)
    results = {variant: ModeResult(variant_name(variant)) for variant in variants}
    with tempfile.TemporaryDirectory(prefix="boot-modes-") as work:
        for run in range(runs):
            for variant in variants:
                boot = boot_once(variant, model, extra_args, cpu, Path(work), timeout)
                results[variant].boots.append(boot)
                if progress:
                    print(
                        f"run {run + 1}/{runs} {boot.mode}: {boot.seconds:.1f} s, "
                        f"{len(boot.processes)} processes",
                        file=sys.stderr,
                        flush=True,
                    )
    return list(results.values())


def table(results: list[ModeResult]) -> str:
    """The results as a Markdown table; 'same answer' compares each mode with the first."""
    reference = results[0].boots[0].answer
    lines = [
        "| mode | boot s (each) | boot s (median) | processes | RSS MiB | "
        f"{ANSWER_TOKENS} tokens s (warm) | same answer |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for result in results:
        boots = result.boots
        each = ", ".join(f"{boot.seconds:.1f}" for boot in boots)
        names = boots[-1].processes
        rss = statistics.median(boot.rss_bytes for boot in boots) / (1 << 20)
        answer_s = statistics.median(boot.answer_seconds for boot in boots)
        same = all(boot.answer == reference for boot in boots)
        lines.append(
            f"| {result.mode} | {each} | {result.median_seconds:.1f} | "
            f"{len(names)} ({', '.join(names)}) | {rss:.0f} | {answer_s:.2f} | "
            f"{'yes' if same else 'NO'} |"
        )
    lines.append("")
    lines.append(f"answer to {PROMPT!r}: {reference!r}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    extra_args: list[str] = []
    if "--" in args_in:
        at = args_in.index("--")
        args_in, extra_args = args_in[:at], args_in[at + 1 :]
    parser = argparse.ArgumentParser(
        description="Time engine boots in each engine_boot_mode (spawn to /health).",
        epilog="Arguments after `--` go to the engine.",
    )
    parser.add_argument("--model", help="model directory (default: the tiny demo base)")
    parser.add_argument("--runs", type=int, default=2, help="boots per mode (default 2)")
    parser.add_argument(
        "--mode", action="append", choices=MODES, help="only these modes (repeatable)"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds one boot may take")
    parser.add_argument(
        "--no-spare", action="store_true", help="leave out the boots taken by a spare engine"
    )
    args = parser.parse_args(args_in)
    model = args.model or str(demo_base_dir(ensure_demo()))
    modes = tuple(args.mode) if args.mode else MODES
    spares = (False,) if args.no_spare else (False, True)
    variants = [(mode, spare) for mode in modes for spare in spares]
    results = measure(variants, max(args.runs, 1), model, extra_args, args.timeout)
    print(table(results))
    return 0
