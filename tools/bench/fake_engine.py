"""An OpenAI-compatible server that answers at once: the upstream for pricing the proxy alone.

It takes vLLM's command line (``--port`` or ``--uds``, ``--api-key``, ``--served-model-name``,
``--lora-modules``; everything else is ignored), so ``gateway serve`` can supervise it as its
engine, and speaks just enough of vLLM's API for that: ``/health``, ``/v1/models``,
``/metrics``, runtime LoRA load/unload, and chat/legacy completions (streamed or not). It is a
raw asyncio protocol with httptools' parser, so it costs far less per request than whatever
sits in front of it.

    python -m tools.bench.fake_engine --port 8100 [--api-key KEY] [--served-model-name NAME]

For the supervisor's tests of stubborn engines: ``--ignore-sigterm`` makes it ignore SIGTERM,
and ``--child`` starts a child process that ignores SIGTERM and renames itself (as vLLM's
EngineCore does, with setproctitle). ``--detached-child=PATH`` starts what Ray's local cluster
looks like from outside: a daemon that leaves the engine's session (``os.setsid()``, as
Ray's driver leaves its group with ``os.setpgrp()``) and starts a worker that ignores
SIGTERM and carries none of the engine's environment tags, then exits, orphaning the worker;
the worker writes its pid to PATH.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import cast

import httptools
import orjson


@dataclass
class FakeEngine:
    api_key: str | None
    models: list[str]
    # Seconds between streamed events (0: the whole stream in one write), like a real engine's
    # time per output token.
    token_interval: float = 0.0
    requests: int = 0
    streams_cut: int = 0  # trickled streams whose client (the gateway) hung up midway
    loaded: dict[str, str] = field(default_factory=dict)


def _response(status: int, body: bytes, content_type: bytes = b"application/json") -> bytes:
    reason = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 404: b"Not Found"}.get(
        status, b"X"
    )
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
        % (status, reason, content_type, len(body))
        + body
    )


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Request(asyncio.Protocol):
    def __init__(self, state: FakeEngine) -> None:
        self.state = state
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.auth = b""
        self.body: list[bytes] = []
        self.header_name = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have the same methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_message_begin(self) -> None:
        self.url = b""
        self.auth = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"authorization":
            self.auth = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        answer = self.answer(self.parser.get_method(), self.url.split(b"?", 1)[0])
        self.transport.write(answer)
        if not self.parser.should_keep_alive():
            self.transport.close()

    def answer(self, method: bytes, path: bytes) -> bytes:
        state = self.state
        if path == b"/health":
            return _response(200, b"")
        if path == b"/metrics":
            text = (
                "# HELP vllm:num_requests_running Requests running.\n"
                "# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{model_name="{state.models[0]}"}} 0.0\n'
                "# HELP vllm:request_success_total Finished requests.\n"
                "# TYPE vllm:request_success_total counter\n"
                f'vllm:request_success_total{{model_name="{state.models[0]}"}} {float(state.requests)}\n'
            )
            return _response(200, text.encode(), b"text/plain; version=0.0.4; charset=utf-8")
        if state.api_key is not None and self.auth != b"Bearer " + state.api_key.encode():
            return _response(401, b'{"error":"Unauthorized"}')
        if path == b"/v1/models":
            data = [{"id": m, "object": "model", "owned_by": "bench"} for m in self.served()]
            return _response(200, orjson.dumps({"object": "list", "data": data}))
        body = orjson.loads(b"".join(self.body) or b"{}")
        if path == b"/v1/load_lora_adapter":
            state.loaded[body["lora_name"]] = body.get("lora_path", "")
            return _response(200, b"Success: LoRA adapter added successfully.", b"text/plain")
        if path == b"/v1/unload_lora_adapter":
            state.loaded.pop(body.get("lora_name", ""), None)
            return _response(200, b"Success: LoRA adapter removed successfully.", b"text/plain")
        if path in (b"/v1/chat/completions", b"/v1/completions"):
            return self.complete(body, chat=path == b"/v1/chat/completions")
        return _response(404, b'{"detail":"Not Found"}')

    def served(self) -> list[str]:
        return [*self.state.models, *self.state.loaded]

    def complete(self, body: dict[str, object], chat: bool) -> bytes:
        model = body.get("model")
        if model not in self.served():
            message = f"The model `{model}` does not exist."
            return _response(404, orjson.dumps({"error": {"message": message, "code": 404}}))
        self.state.requests += 1
        tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        assert isinstance(tokens, int)
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if body.get("stream") is not True:
            choice: dict[str, object] = {"index": 0, "finish_reason": "length", "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": " x" * tokens}
            else:
                choice["text"] = " x" * tokens
            answer = {
                "id": "cmpl-bench", "object": kind, "created": created, "model": model,
                "choices": [choice],
                "usage": {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens},
            }  # fmt: skip
            return _response(200, orjson.dumps(answer))
        head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        events = []
        for index in range(tokens):
            delta: dict[str, object] = {"index": 0, "finish_reason": None}
            if chat:
                delta["delta"] = (
                    {"content": " x"} if index else {"role": "assistant", "content": " x"}
                )
            else:
                delta["text"] = " x"
            chunk = {
                "id": "cmpl-bench",
                "object": kind + ".chunk",
                "created": created,
                "model": model,
                "choices": [delta],
            }
            events.append(_chunk(b"data: " + orjson.dumps(chunk) + b"\n\n"))
        events.append(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        if self.state.token_interval <= 0:
            return head + b"".join(events)
        asyncio.get_running_loop().create_task(self.trickle(events))
        return head

    async def trickle(self, events: list[bytes]) -> None:
        for event in events:
            await asyncio.sleep(self.state.token_interval)
            if self.transport is None or self.transport.is_closing():
                self.state.streams_cut += 1
                return
            self.transport.write(event)


@dataclass(frozen=True)
class Listen:
    """Where to listen: ``uds`` (a Unix socket path) when set, else ``host:port``."""

    host: str = "127.0.0.1"
    port: int = 8000
    uds: str | None = None


def parse_args(argv: list[str]) -> tuple[Listen, FakeEngine]:
    """vLLM's flags that matter here; the rest are accepted and ignored."""
    # Like vLLM, the key may come from VLLM_API_KEY (that is how the supervisor passes it).
    host, port, key, names, interval = "127.0.0.1", 8000, os.environ.get("VLLM_API_KEY"), [], 0.0
    uds: str | None = None
    index = 0
    while index < len(argv):
        arg = argv[index]
        nxt = argv[index + 1] if index + 1 < len(argv) else ""
        if arg == "--host":
            host = nxt
        elif arg == "--port":
            port = int(nxt)
        elif arg == "--uds":
            uds = nxt
        elif arg == "--api-key":
            key = nxt
        elif arg == "--token-interval":
            interval = float(nxt)
        elif arg == "--served-model-name":
            names.append(nxt)
        elif arg == "--lora-modules":
            index += 1
            while index < len(argv) and not argv[index].startswith("--"):
                spec = argv[index]
                names.append(
                    orjson.loads(spec)["name"] if spec.startswith("{") else spec.split("=")[0]
                )
                index += 1
            continue
        index += 1
    return (
        Listen(host, port, uds),
        FakeEngine(api_key=key, models=names or ["bench-model"], token_interval=interval),
    )


async def start_server(state: FakeEngine, host: str = "127.0.0.1", port: int = 0) -> asyncio.Server:
    """Listen on ``host:port`` (0: any free port) and answer as the engine ``state`` describes."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Request(state), host, port, backlog=1024)


async def start_unix_server(state: FakeEngine, path: str) -> asyncio.Server:
    """Listen on the Unix socket ``path``, like vLLM's ``--uds``."""
    loop = asyncio.get_running_loop()
    return await loop.create_unix_server(lambda: _Request(state), path, backlog=1024)


async def serve(listen: Listen, state: FakeEngine, ignore_sigterm: bool = False) -> None:
    if listen.uds is not None:
        server = await start_unix_server(state, listen.uds)
    else:
        server = await start_server(state, listen.host, listen.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT,) if ignore_sigterm else (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


_DETACHED_WORKER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1] + ".tmp", "w") as file:
    file.write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(3600)
"""
_DETACHED_DAEMON = """
import os, subprocess, sys
os.setsid()
env = {k: v for k, v in os.environ.items() if not k.startswith("LORAGATE_")}
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env=env)
"""


def start_detached_worker(pid_file: str) -> None:
    """A daemon in a session of its own that leaves an orphaned worker behind (see above)."""
    subprocess.Popen([sys.executable, "-c", _DETACHED_DAEMON, _DETACHED_WORKER, pid_file])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    listen, state = parse_args(args)
    ignore_sigterm = "--ignore-sigterm" in args
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "--child" in args:
        # Renamed like vLLM's EngineCore: setproctitle overwrites what /proc/PID/environ shows.
        stubborn = (
            "import signal, time, setproctitle; "
            "setproctitle.setproctitle('FAKE::EngineCore, renamed like vLLM renames its own'); "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"
        )
        subprocess.Popen([sys.executable, "-c", stubborn])
    detached = [arg.partition("=")[2] for arg in args if arg.startswith("--detached-child=")]
    if detached:
        start_detached_worker(detached[0])
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(listen, state, ignore_sigterm))
    else:
        uvloop.run(serve(listen, state, ignore_sigterm))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
