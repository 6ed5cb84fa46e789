"""Starting and stopping what the bench measures: ``gateway serve``, nginx, a fake engine.

Every process is started here as a child of the bench and stopped in ``close()`` (SIGTERM,
then SIGKILL), so a bench run leaves nothing behind; ``gateway serve`` stops its own engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from tools.bench.load import Target

FAKE_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _pinned(cpus: set[int] | None) -> Callable[[], None] | None:
    if not cpus:
        return None

    def pin() -> None:
        os.sched_setaffinity(0, cpus)

    return pin


@contextlib.contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    if not cpus:
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


@dataclass
class EngineRecord:
    """Where ``engine_tap`` saw the engine listen (its Unix socket; a port for engines given
    ``--port`` by hand) and its key."""

    port: int | None
    api_key: str | None
    uds: str | None = None
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return "http://engine" if self.uds else f"http://{self.host}:{self.port}"

    def client(self, timeout: float = 10) -> httpx.Client:
        """An httpx client that reaches the engine (over its socket when it has one)."""
        transport = httpx.HTTPTransport(uds=self.uds) if self.uds else None
        return httpx.Client(transport=transport, timeout=timeout, trust_env=False)

    def target(self, name: str, model: str) -> Target:
        """A load target that sends ``model`` to the engine directly, with its key."""
        return Target(name, self.host, self.port or 0, model, self.api_key, uds=self.uds)

    def nginx_upstream(self) -> str:
        return f"unix:{self.uds}" if self.uds else f"{self.host}:{self.port}"


class Process:
    """A child process with a log file; ``stop`` ends it (and, by SIGTERM, what it started)."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        cpus: set[int] | None = None,
    ) -> None:
        self.name = name
        self.log = log
        with log.open("ab") as handle:
            self.proc = subprocess.Popen(
                argv,
                stdout=handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                preexec_fn=_pinned(cpus),
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check(self) -> None:
        if not self.alive():
            raise RuntimeError(
                f"{self.name} exited with {self.proc.returncode}; log:\n{self.tail()}"
            )

    def tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def rss(self) -> int:
        return int(psutil.Process(self.pid).memory_info().rss)

    def cpu_seconds(self) -> float:
        times = psutil.Process(self.pid).cpu_times()
        return float(times.user + times.system)


def wait_http(url: str, process: Process, timeout: float, want: int = 200) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        process.check()
        try:
            response = httpx.get(url, timeout=5)
            if response.status_code == want:
                return
            last = f"{response.status_code} {response.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.25)
    raise TimeoutError(
        f"{url} did not answer {want} within {timeout:g} s (last: {last}); log:\n{process.tail()}"
    )


class GatewayServe(Process):
    """``gateway serve`` supervising an engine command wrapped by ``engine_tap`` (``gateway
    demo`` without a ``model``)."""

    def __init__(
        self,
        workdir: Path,
        engine_command: list[str],
        model: str | None = None,
        cpus: set[int] | None = None,
        engine_cpus: set[int] | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.port = free_port()
        self.record = workdir / "engine.json"
        tap = [sys.executable, "-m", "tools.bench.engine_tap", str(self.record), "--"]
        config_yaml = workdir / "gateway.yaml"  # JSON is YAML
        config_yaml.write_text(json.dumps({"engine_command": tap + engine_command}))
        argv = [
            sys.executable, "-m", "loragate.cli", "serve" if model else "demo",
            "--port", str(self.port),
            "--cache-dir", str(workdir / "cache"),
            "--config", str(config_yaml),
            *(["--model", model] if model else []),
            *(extra_args or []),
        ]  # fmt: skip
        env = {"LORAGATE_LOG_LEVEL": "warning"}
        if engine_cpus:
            env["LORAGATE_BENCH_ENGINE_CPUS"] = ",".join(str(c) for c in sorted(engine_cpus))
        super().__init__("gateway serve", argv, workdir / "gateway.log", env=env, cpus=cpus)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        wait_http(self.url + "/health", self, timeout)

    def engine(self) -> EngineRecord:
        data = json.loads(self.record.read_text())
        port = data.get("port")
        return EngineRecord(
            port=int(port) if port else None, api_key=data.get("api_key"), uds=data.get("uds")
        )

    def models(self) -> list[str]:
        response = httpx.get(self.url + "/v1/models", timeout=10)
        response.raise_for_status()
        return [m["id"] for m in response.json()["data"]]


class UpstreamGateway(Process):
    """``gateway serve --upstream-url URL``: the gateway in front of an engine it does not run."""

    def __init__(
        self,
        workdir: Path,
        upstream: str,
        api_key: str | None,
        cpus: set[int] | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.port = free_port()
        argv = [
            sys.executable, "-m", "loragate.cli", "serve",
            "--port", str(self.port),
            "--cache-dir", str(workdir / "cache"),
            "--upstream-url", upstream,
            *(extra_args or []),
        ]  # fmt: skip
        env = {"LORAGATE_LOG_LEVEL": "warning"}
        if api_key:
            env["LORAGATE_UPSTREAM_API_KEY"] = api_key
        super().__init__(
            "gateway serve --upstream-url", argv, workdir / "gateway.log", env=env, cpus=cpus
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        wait_http(self.url + "/health", self, timeout)


class ProcessTree(Process):
    """A process whose children serve too (nginx's workers, Granian's): measured together."""

    def workers(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        return []

    def rss(self) -> int:
        return sum(int(p.memory_info().rss) for p in self.workers())

    def cpu_seconds(self) -> float:
        total = 0.0
        for p in self.workers():
            with contextlib.suppress(psutil.Error):
                times = p.cpu_times()
                total += times.user + times.system
        return total


class Nginx(ProcessTree):
    """nginx as a reverse proxy with a keep-alive upstream: the floor a proxy can reach."""

    def __init__(self, workdir: Path, upstream: str, cpus: set[int] | None = None) -> None:
        """``upstream`` as nginx's ``server`` takes it: ``127.0.0.1:PORT`` or ``unix:PATH``."""
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        workdir.mkdir(parents=True, exist_ok=True)
        workdir.chmod(0o755)  # nginx workers may run as another user
        self.port = free_port()
        conf = workdir / "nginx.conf"
        # Started as root, nginx runs its workers as "nobody", who cannot enter the engine's
        # private socket directory: keep them as this user (ignored when not root).
        user = f"user {pwd.getpwuid(os.geteuid()).pw_name};" if os.geteuid() == 0 else ""
        conf.write_text(
            f"""
{user}
worker_processes 1;
daemon off;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {workdir}/body;
    proxy_temp_path {workdir}/proxy;
    fastcgi_temp_path {workdir}/fastcgi;
    uwsgi_temp_path {workdir}/uwsgi;
    scgi_temp_path {workdir}/scgi;
    upstream engine {{
        server {upstream};
        keepalive 128;
        keepalive_timeout 4s;
    }}
    server {{
        listen 127.0.0.1:{self.port};
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""
        )
        argv = [binary, "-p", str(workdir), "-c", str(conf)]
        super().__init__("nginx", argv, workdir / "nginx.log", cpus=cpus)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 10) -> None:
        wait_listening(self, self.port, timeout)


def wait_listening(process: Process, port: int, timeout: float) -> None:
    """Wait until ``process`` accepts connections on 127.0.0.1:``port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process.check()
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", port), timeout=1),
        ):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{process.name} did not listen; log:\n{process.tail()}")


def nginx_available() -> bool:
    return shutil.which("nginx") is not None or Path("/usr/sbin/nginx").exists()


def write_fake_model(directory: Path) -> Path:
    """A model directory with just a config.json: all the gateway reads of a base model."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(FAKE_MODEL_CONFIG))
    return directory


class MinimalProxy(Process):
    """``minimal_proxy``: a bare ASGI proxy with loragate's upstream client (the floor reference)."""

    def __init__(self, workdir: Path, engine: EngineRecord, cpus: set[int] | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        argv = [
            sys.executable, "-m", "tools.bench.minimal_proxy",
            "--port", str(self.port),
            "--upstream", engine.url,
            *(["--upstream-uds", engine.uds] if engine.uds else []),
        ]  # fmt: skip
        api_key = engine.api_key
        env = {"LORAGATE_BENCH_UPSTREAM_KEY": api_key} if api_key else {}
        super().__init__("minimal proxy", argv, workdir / "minimal-proxy.log", env=env, cpus=cpus)

    def wait_ready(self, timeout: float = 30) -> None:
        wait_listening(self, self.port, timeout)
