"""A lean closed-loop HTTP/1.1 load generator: keep-alive connections, requests prepared once.

Every target gets byte-identical requests except for the model name and the key, built once
and written as-is; answers are parsed by httptools. That keeps the client's own cost per
request in the tens of microseconds, so what is measured is the server side.

Two workloads:

- ``interleaved``: N workers, each with one connection per target, send the same request to
  every target in turn (the order rotating each round), so the machine's noise and the
  engine's load hit all targets alike. Latency samples per target.
- ``blocks``: N workers saturate one target for a few seconds, then the next, in rotating
  order, several rounds: throughput per target, with a hook around each block (CPU time,
  memory).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import cast

import httptools
import orjson

_TOKEN_EVENT = re.compile(rb'"(?:content|text)":"[^"]')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":(\d+)')


@dataclass(frozen=True)
class Target:
    """Where one variant of the workload goes: ``direct``, ``loragate`` or ``nginx``."""

    name: str
    host: str
    port: int
    model: str
    api_key: str | None = None
    # The engine listens on a Unix socket: connect there (host and port then name nothing).
    uds: str | None = None

    @property
    def authority(self) -> str:
        return "engine" if self.uds else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Workload:
    path: str = "/v1/chat/completions"
    prompt: str = "Hello there, how are you?"
    max_tokens: int = 1
    stream: bool = False

    def request(self, target: Target) -> bytes:
        body: dict[str, object] = {
            "model": target.model,
            "max_tokens": self.max_tokens,
            "temperature": 0,
        }
        if self.path.endswith("/chat/completions"):
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if self.stream:
            body["stream"] = True
        raw = orjson.dumps(body)
        head = [
            f"POST {self.path} HTTP/1.1",
            f"Host: {target.authority}",
            "Content-Type: application/json",
            f"Content-Length: {len(raw)}",
        ]
        if target.api_key:
            head.append(f"Authorization: Bearer {target.api_key}")
        return ("\r\n".join(head) + "\r\n\r\n").encode() + raw


@dataclass
class Sample:
    latency: float
    ttft: float | None
    status: int
    tokens: int


class _ClientConnection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.done: asyncio.Future[None] | None = None
        self.started = 0.0
        self.first_token = 0.0
        self.tokens = 0
        self.body: list[bytes] = []
        self.stream = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have the same methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._finish(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(exc or ConnectionResetError("the server closed the connection"))

    def on_body(self, body: bytes) -> None:
        if self.stream:
            found = len(_TOKEN_EVENT.findall(body))
            if found and not self.first_token:
                self.first_token = time.perf_counter()
            self.tokens += found
        else:
            self.body.append(body)

    def on_message_complete(self) -> None:
        self._finish(None)

    def _finish(self, error: BaseException | None) -> None:
        if self.done is not None and not self.done.done():
            if error is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(error)

    async def roundtrip(self, request: bytes, stream: bool) -> Sample:
        assert self.transport is not None
        self.done = asyncio.get_running_loop().create_future()
        self.first_token = 0.0
        self.tokens = 0
        self.body = []
        self.stream = stream
        self.started = started = time.perf_counter()
        self.transport.write(request)
        await self.done
        ended = time.perf_counter()
        status = self.parser.get_status_code()
        tokens = self.tokens
        if not stream:
            found = _COMPLETION_TOKENS.search(b"".join(self.body))
            tokens = int(found.group(1)) if found else 0
        ttft = self.first_token - started if self.first_token else None
        return Sample(ended - started, ttft, status, tokens)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()


async def connect(target: Target) -> _ClientConnection:
    loop = asyncio.get_running_loop()
    if target.uds:
        _, unix_conn = await loop.create_unix_connection(_ClientConnection, target.uds)
        return unix_conn
    _, conn = await loop.create_connection(_ClientConnection, target.host, target.port)
    return conn


class _Client:
    """One keep-alive connection to one target, reopened when the server closed it."""

    def __init__(self, target: Target, conn: _ClientConnection) -> None:
        self.target = target
        self.conn = conn

    @classmethod
    async def open(cls, target: Target) -> _Client:
        return cls(target, await connect(target))

    async def send(self, request: bytes, stream: bool) -> Sample:
        if not self.conn.usable:  # closed while idle (keep-alive timeout)
            self.conn = await connect(self.target)
        try:
            return await self.conn.roundtrip(request, stream)
        except (ConnectionError, httptools.HttpParserError):
            self.conn.close()
            self.conn = await connect(self.target)
            return Sample(latency=math.nan, ttft=None, status=0, tokens=0)

    def close(self) -> None:
        self.conn.close()


@dataclass
class Samples:
    """Per target: latency samples in send order, and failures."""

    by_target: dict[str, list[Sample]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)

    def add(self, target: str, sample: Sample) -> None:
        if sample.status != 200:
            self.errors[target] = self.errors.get(target, 0) + 1
        self.by_target.setdefault(target, []).append(sample)


async def interleaved(
    targets: list[Target], workload: Workload, concurrency: int, rounds: int, gap: float = 0.0
) -> Samples:
    """``concurrency`` workers each send ``rounds`` x every target, alternating targets.

    ``gap`` seconds of pause after each answer let the engine finish its work for the last
    request first, so every request meets an idle engine (as a single user's would).
    """
    requests = {t.name: workload.request(t) for t in targets}
    samples = Samples()

    async def worker(index: int) -> None:
        clients = {t.name: await _Client.open(t) for t in targets}
        try:
            for round_ in range(rounds):
                shift = (round_ + index) % len(targets)
                for target in targets[shift:] + targets[:shift]:
                    sample = await clients[target.name].send(requests[target.name], workload.stream)
                    samples.add(target.name, sample)
                    if gap:
                        await asyncio.sleep(gap)
        finally:
            for client in clients.values():
                client.close()

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return samples


@dataclass
class Block:
    target: str
    requests: int
    tokens: int
    errors: int
    seconds: float


BlockHook = Callable[[str], Awaitable[None]]


async def _saturate(
    target: Target, request: bytes, stream: bool, clients: list[_Client], seconds: float
) -> Block:
    deadline = time.perf_counter() + seconds
    counts = [0, 0, 0]  # requests, tokens, errors

    async def worker(client: _Client) -> None:
        while time.perf_counter() < deadline:
            sample = await client.send(request, stream)
            counts[0] += 1
            counts[1] += sample.tokens
            counts[2] += sample.status != 200

    started = time.perf_counter()
    await asyncio.gather(*(worker(client) for client in clients))
    return Block(target.name, counts[0], counts[1], counts[2], time.perf_counter() - started)


async def blocks(
    targets: list[Target],
    workload: Workload,
    concurrency: int,
    seconds: float,
    rounds: int,
    before: BlockHook | None = None,
    after: BlockHook | None = None,
) -> list[Block]:
    """Saturate each target in turn for ``seconds`` with ``concurrency`` connections, ``rounds`` times."""
    requests = {t.name: workload.request(t) for t in targets}
    results: list[Block] = []
    for round_ in range(rounds):
        shift = round_ % len(targets)
        for target in targets[shift:] + targets[:shift]:
            # Fresh connections per block: servers close keep-alive connections idle for 5 s.
            clients = [await _Client.open(target) for _ in range(concurrency)]
            try:
                if before is not None:
                    await before(target.name)
                block = await _saturate(
                    target, requests[target.name], workload.stream, clients, seconds
                )
                if after is not None:
                    await after(target.name)
            finally:
                for client in clients:
                    client.close()
            results.append(block)
    return results
