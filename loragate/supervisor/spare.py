"""A spare engine: a launcher whose engine has already imported vLLM and waits for the
arguments of the next boot, so that a boot, a restart or a catalog's swap costs little more
than loading the weights (issue 26; ``scripts/boot_modes.py`` measures it).

``SpareEngines`` keeps at most one spare per gateway. A spare is the launcher every boot runs
(``loragate.supervisor.launcher``, its no-orphan guarantees unchanged), in a session of its own,
with ``python -m loragate.supervisor.spare`` as its engine: that process imports vLLM's API
server and engine, then reads one line from its standard input, the boot's order
(``{"args": [...], "env": {...}}``), takes the boot's environment and runs vLLM's API server as
``python -m`` would. The boot's ``EngineProcess`` then owns that launcher as if it had spawned
it.

A spare serves only a boot of vLLM's own API server (no ``engine_command``) in the same Python,
and only when what a process reads once, while it imports (``import_time_env``), is the same in
the boot's environment as in the spare's; any other boot spawns as before. A spare that died
meanwhile is dropped. The spare's pid file (``spare.pid`` in the gateway's cache dir) lets the
next gateway end a spare that a killed one left behind.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import runpy
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from loragate.settings import Settings
from loragate.supervisor.command import ENGINE_MODULE
from loragate.supervisor.process import (
    ENGINE_TAG,
    EnginePidFile,
    Launcher,
    kill_tree_now,
    spawn_launcher,
)

log = logging.getLogger("loragate.supervisor")

SPARE_MODULE = "loragate.supervisor.spare"
# What a boot imports on its way to /health, most of its import time; a module missing from
# this vLLM is skipped (the boot imports what it needs anyway).
PRE_IMPORTS = (
    ENGINE_MODULE,
    "vllm.entrypoints.openai.cli_args",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core",
    "vllm.v1.worker.gpu_model_runner",  # the CPU build's model runner is one too
    "vllm.model_executor.model_loader",
    "vllm.model_executor.models.registry",
    "vllm.lora.worker_manager",
)
# Read by a process once, while it imports (the C runtime, the allocator, torch, logging, the
# interpreter): a boot whose value differs from the spare's cannot use the spare.
_IMPORT_TIME_PREFIXES = (
    "LD_",
    "OMP_",
    "KMP_",
    "MKL_",
    "MALLOC",
    "PYTHON",
    "CUDA_",
    "HIP_",
    "ROCR_",
    "TORCH",
    "PYTORCH",
    "TRITON",
    "HF_",
    "TRANSFORMERS",
    "VLLM_CONFIGURE_LOGGING",
    "VLLM_LOGGING",
    "VLLM_TARGET_DEVICE",
    "VLLM_PLUGINS",
)


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if name.startswith(_IMPORT_TIME_PREFIXES)}


@dataclass
class SpareEngine:
    """One spared launcher, waiting for its order."""

    proc: Launcher
    tag: str
    python: str
    env: dict[str, str]
    spawned_at: float  # time.monotonic()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def serves(self, argv: list[str], env: dict[str, str]) -> bool:
        return (
            argv[:3] == [self.python, "-m", ENGINE_MODULE]
            and import_time_env(env) == import_time_env(self.env)
            and self.alive()
        )


def spare_engines(settings: Settings, *, models: int) -> SpareEngines | None:
    """The spare engines of a gateway serving ``models`` base models with ``settings``: on
    when ``spare_engine`` says so, by default for a catalog of more than one; never for an
    ``engine_command`` (a spare runs vLLM's own API server)."""
    wanted = settings.spare_engine if settings.spare_engine is not None else models > 1
    if not wanted or settings.engine_command:
        return None
    cache_dir = settings.cache_dir.expanduser().resolve()
    return SpareEngines(cache_dir, python=settings.engine_python, grace=settings.stop_timeout)


class SpareEngines:
    """At most one spare engine, for whichever boot of this gateway comes next."""

    def __init__(self, cache_dir: Path, *, python: str, grace: float) -> None:
        self._pidfile = EnginePidFile(cache_dir, name="spare.pid")
        self.python = python
        self.grace = grace
        self._spare: SpareEngine | None = None
        self.taken = 0  # boots that took a spare

    @property
    def waiting(self) -> SpareEngine | None:
        """The spare waiting for a boot, if one is alive."""
        spare = self._spare
        return spare if spare is not None and spare.alive() else None

    def report(self) -> dict[str, object]:
        """``GET /admin/engine``'s ``spare_engine``: the waiting spare's launcher, since when,
        and how many boots took one."""
        spare = self.waiting
        return {
            "launcher_pid": spare.proc.pid if spare is not None else None,
            "waiting_s": round(time.monotonic() - spare.spawned_at, 1) if spare else None,
            "boots_taken": self.taken,
        }

    def end_stale(self) -> None:
        """End a spare a previous gateway on this cache dir left running (blocking)."""
        self._pidfile.end_stale_engine()

    def replenish(self, env: dict[str, str]) -> None:
        """Spawn a spare, with ``env`` (a boot's environment, its per-boot key dropped), unless
        one is waiting already."""
        if self.waiting is not None:
            return
        env = {name: value for name, value in env.items() if name != "VLLM_API_KEY"}
        argv = [self.python, "-m", SPARE_MODULE]
        proc = spawn_launcher(argv, env, self.grace, stdin=subprocess.PIPE)
        tag = env[ENGINE_TAG]
        self._pidfile.write(proc.pid, tag)
        self._spare = SpareEngine(proc, tag, self.python, env, time.monotonic())
        log.info(
            "spare engine spawned (launcher pid %s): it imports vLLM for the next boot", proc.pid
        )

    def take(self, argv: list[str], env: dict[str, str]) -> SpareEngine | None:
        """The waiting spare, given the boot ``argv`` and ``env`` (whose tag becomes the
        spare's), or None when there is none that serves this boot."""
        spare, self._spare = self._spare, None
        if spare is None:
            return None
        if not spare.serves(argv, env):
            self._end(spare)
            return None
        env[ENGINE_TAG] = spare.tag
        order = json.dumps({"args": argv[3:], "env": env}) + "\n"
        assert spare.proc.stdin is not None
        try:
            spare.proc.stdin.write(order.encode())
            spare.proc.stdin.close()
        except OSError:  # it died just now
            self._end(spare)
            return None
        self._pidfile.clear()
        self.taken += 1
        log.info(
            "the spare engine (launcher pid %s, spawned %.0f s ago) takes this boot",
            spare.proc.pid,
            time.monotonic() - spare.spawned_at,
        )
        return spare

    def close(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None:
            self._end(spare)

    def _end(self, spare: SpareEngine) -> None:
        with contextlib.suppress(psutil.Error, OSError):
            kill_tree_now(spare.proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            spare.proc.wait(5)
        if spare.proc.stdout is not None:
            spare.proc.stdout.close()
        if spare.proc.stdin is not None:
            with contextlib.suppress(OSError):
                spare.proc.stdin.close()
        self._pidfile.clear()


def main() -> int:
    """The spare's own process: import, wait for the order, serve it."""
    began = time.monotonic()
    for module in PRE_IMPORTS:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    imported = time.monotonic() - began
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the gateway ended the spare without a boot for it
    order = json.loads(line)
    os.environ.clear()
    os.environ.update(order["env"])
    print(
        f"loragate: spare engine (pid {os.getpid()}, vLLM imported in {imported:.1f} s) takes this boot",
        flush=True,
    )
    sys.argv = [ENGINE_MODULE, *order["args"]]
    runpy.run_module(ENGINE_MODULE, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
