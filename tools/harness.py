"""A real `gateway serve` (or `gateway demo`) process, driven like a user would: for
integration tests and the measurement scripts in scripts/ (recovery, swap latency, soak,
bench)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from loragate.demo.layout import default_demo_dir
from loragate.paths import default_cache_dir

GATEWAY = Path(sys.executable).parent / "gateway"
ADMIN_KEY = "test-admin-key"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# The options that say what `gateway serve` serves; without one, only `gateway demo` starts.
MODEL_OPTIONS = ("--model", "--pretrained-model-name-or-path", "--upstream-url", "--run-id")


def names_a_model(args: list[str]) -> bool:
    """Whether gateway options ``args`` (up to a ``--``) name a model, an upstream or a run."""
    own = args[: args.index("--")] if "--" in args else args
    return any(arg.split("=", 1)[0] in MODEL_OPTIONS for arg in own)


@dataclass
class GatewayProcess:
    cache_dir: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    health_seen: list[int] = field(default_factory=list)
    # What starts the gateway, e.g. ["scripts/serve.sh"]; by default `gateway serve` when
    # ``args`` name a model (or an upstream or Vi run), else `gateway demo`.
    launcher: list[str] | None = None
    # Which bundled demo `gateway demo` serves: the tests' fast tiny model unless a test asks
    # for the real one ("smollm2").
    demo: str = "tiny"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.cache_dir / "gateway-test.log"

    def start(self) -> GatewayProcess:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            *(self.launcher or [str(GATEWAY), "serve" if names_a_model(self.args) else "demo"]),
            "--port", str(self.port),
            "--cache-dir", str(self.cache_dir),
            "--admin-key", ADMIN_KEY,
            *self.args,
        ]  # fmt: skip
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "LORAGATE_DEMO": self.demo,
            # A third shorter a boot, the guarantees kept (tests/integration/test_boot_modes.py);
            # the tests of the engine's process tree ask for the product's default themselves.
            "LORAGATE_ENGINE_BOOT_MODE": "single-process",
            # Where the tests' adapters lie (their temporary dirs, the demo's, the default
            # cache dir): the admin API reads local sources only under these roots.
            "LORAGATE_ADAPTER_SOURCE_ROOTS": json.dumps(
                [tempfile.gettempdir(), str(default_demo_dir()), str(default_cache_dir())]
            ),
            **self.env,
        }
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        return self

    def health(self) -> tuple[int, dict[str, Any]]:
        response = httpx.get(f"{self.url}/health", timeout=5, trust_env=False)
        return response.status_code, response.json()

    def wait_listening(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"{self.url}/health/live", timeout=2, trust_env=False)
                return
            time.sleep(0.1)
        raise TimeoutError(f"gateway did not listen within {timeout} s; log: {self.log_tail()}")

    def wait_status(
        self, want: int = 200, timeout: float = 300, state: str | None = None
    ) -> dict[str, Any]:
        """Poll /health until it answers ``want`` (and, if given, body status ``state``)."""
        deadline = time.monotonic() + timeout
        body: dict[str, Any] = {}
        while time.monotonic() < deadline:
            self._check_alive()
            with contextlib.suppress(httpx.HTTPError, ValueError):
                code, body = self.health()
                self.health_seen.append(code)
                if code == want and (state is None or body.get("status") == state):
                    return body
            time.sleep(0.25)
        raise TimeoutError(
            f"/health never answered {want} {state or ''}: last {body}; log: {self.log_tail()}"
        )

    def wait_ready(self, timeout: float = 300) -> GatewayProcess:
        self.wait_listening(timeout)
        self.wait_status(200, timeout)
        return self

    def admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        return httpx.request(
            method, f"{self.url}{path}", headers=headers, timeout=300, trust_env=False, **kwargs
        )

    def engine_info(self) -> dict[str, Any]:
        response = self.admin("GET", "/admin/engine")
        response.raise_for_status()
        return dict(response.json())

    def engine_tree_pids(self) -> list[int]:
        """The engine launcher and every process under it (API server, EngineCore, Worker)."""
        info = self.engine_info()
        launcher = info.get("launcher_pid")
        if launcher is None:
            return []
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(launcher)
            return [launcher, *(p.pid for p in root.children(recursive=True))]
        return []

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 60) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def log_tail(self, lines: int = 60) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(
                f"gateway exited with {self.proc.returncode}; log:\n{self.log_tail()}"
            )


def wait_gone(pids: list[int], timeout: float = 30) -> list[int]:
    """Pids still alive after ``timeout`` (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    alive = pids
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if _alive(pid)]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
