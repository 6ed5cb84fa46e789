"""Attackers for the soak: connections that hold the gateway's sockets without being requests,
and requests that cost more than they look.

Held connections, each of which took every route down before the gateway had its deadlines
(issues 24 and 33): *idle* sockets that connect and send nothing, *slow-header* clients that
send a request line and then one header byte a second, and *trickle-body* clients that send a
request's headers and then its body a byte every half second (never silent, so only the
whole-body deadline ends them; until then each holds a ``--limit-concurrency`` slot). Each
reopens as soon as the gateway closes it, so the pressure is constant for the whole soak.

Requests (issue 33): *wide* bodies, 2 MB of numbers sent to ``/tokenize`` every two seconds,
which must be answered (a 2xx or 4xx) within the probe timeout; *departing* clients that send
half a body and hang up, five a second, which must never count as the gateway's 500.

Beside them a *liveness prober* asks ``/health/live`` every half second on a fresh connection,
as the kubelet does, with a short timeout.

The verdict: every probe answered 200; every held connection closed by the gateway within its
deadline (its lifetime is kept); every wide body answered in time; no 500 in
``loragate_requests_total`` from the soak's start to its end. (A client that never reads its
answer is closed by the write deadline; from the client's side that close is not visible until
it reads, so ``tests/unit/test_connection_hygiene.py`` pins it from the gateway's side.)
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

# "soak" is no host the gateway serves: the requests that must reach its checks name the
# gateway's own address instead (``Attackers._here``); a slow header never gets that far.
SLOW_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\n"
TRICKLE_LENGTH = 4096
TRICKLE_HEAD = SLOW_HEAD + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (
    TRICKLE_LENGTH
)
WIDE_BODY = b'{"model": "%s", "prompt": "hi", "extra": [' + b"0," * 999_999 + b"0]}"
_SERVER_ERRORS = re.compile(rb'^loragate_requests_total\{[^}]*status="500"\} (\S+)$', re.M)


@dataclass
class AttackPlan:
    host: str
    port: int
    idle: int = 128  # idle sockets held at once
    slow_headers: int = 4
    head_deadline_s: float = 20.0  # the gateway's header deadline, with slack
    probe_timeout_s: float = 3.0
    trickle_bodies: int = 0
    body_deadline_s: float = 20.0  # the gateway's whole-body deadline, with slack
    wide_model: str | None = None  # a model for the wide /tokenize bodies (None: none sent)
    departing: bool = False
    metrics_key: str | None = None  # for /metrics, if it asks for a key

    def deadline(self, kind: str) -> float:
        return self.body_deadline_s if kind == "trickle_body" else self.head_deadline_s


@dataclass
class AttackResult:
    plan: AttackPlan
    lifetimes: dict[str, list[float]] = field(default_factory=dict)  # kind -> closed by server
    open_at_end: dict[str, int] = field(default_factory=dict)  # kind -> still open at the stop
    probes: int = 0
    probe_failures: list[tuple[float, str]] = field(default_factory=list)
    wide: list[tuple[float, str]] = field(default_factory=list)  # seconds to answer, status
    departed: int = 0
    server_errors: float | None = None  # 500s counted by the gateway during the soak

    def problems(self) -> list[str]:
        plan = self.plan
        problems = []
        if self.probe_failures:
            first = self.probe_failures[0]
            problems.append(
                f"{len(self.probe_failures)} of {self.probes} /health/live probes failed "
                f"(first at {first[0]:.1f} s: {first[1]})"
            )
        for kind, lifetimes in sorted(self.lifetimes.items()):
            bound = plan.deadline(kind)
            late = [t for t in lifetimes if t > bound]
            if late:
                problems.append(
                    f"{len(late)} {kind} connections lived past {bound:g} s (longest "
                    f"{max(late):.1f} s)"
                )
        for kind, wanted in (
            ("idle", plan.idle),
            ("slow_header", plan.slow_headers),
            ("trickle_body", plan.trickle_bodies),
        ):
            if wanted and not self.lifetimes.get(kind):
                problems.append(f"the gateway never closed an {kind} connection")
        bad = [(t, s) for t, s in self.wide if t > plan.probe_timeout_s or s[:1] not in "24"]
        if bad:
            problems.append(
                f"{len(bad)} of {len(self.wide)} wide bodies got no 2xx or 4xx within "
                f"{plan.probe_timeout_s:g} s (first: {bad[0][1]} after {bad[0][0]:.1f} s)"
            )
        if plan.wide_model and not self.wide:
            problems.append("no wide body was answered")
        if self.server_errors:
            problems.append(f"the gateway counted {self.server_errors:g} 500s during the soak")
        return problems

    def report(self) -> str:
        lines = [f"attackers: {self.probes} liveness probes, {len(self.probe_failures)} failed"]
        for kind, lifetimes in sorted(self.lifetimes.items()):
            if lifetimes:
                lines.append(
                    f"  {kind}: {len(lifetimes)} closed by the gateway, after "
                    f"{min(lifetimes):.1f}-{max(lifetimes):.1f} s; "
                    f"{self.open_at_end.get(kind, 0)} open at the stop"
                )
        if self.wide:
            slowest = max(t for t, _ in self.wide)
            statuses = sorted({s for _, s in self.wide})
            lines.append(
                f"  wide bodies: {len(self.wide)} answered ({', '.join(statuses)}), the slowest "
                f"after {slowest:.2f} s"
            )
        if self.plan.departing:
            lines.append(f"  departing clients: {self.departed} hung up mid-body")
        if self.server_errors is not None:
            lines.append(f"  500s counted by the gateway meanwhile: {self.server_errors:g}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Attackers:
    def __init__(self, plan: AttackPlan) -> None:
        self.plan = plan
        self.result = AttackResult(plan)
        self.began = time.monotonic()
        self._open: dict[str, int] = {}

    def now(self) -> float:
        return time.monotonic() - self.began

    def _here(self, head: bytes) -> bytes:
        """``head`` naming the gateway's address as its Host, so its checks run, not a 403."""
        host = f"Host: {self.plan.host}:{self.plan.port}".encode()
        return head.replace(b"Host: soak", host, 1)

    async def run(self, stop: asyncio.Event) -> AttackResult:
        plan = self.plan
        errors_before = await self._server_errors()
        tasks = [asyncio.create_task(self._prober(stop))]
        for kind, count in (
            ("idle", plan.idle),
            ("slow_header", plan.slow_headers),
            ("trickle_body", plan.trickle_bodies),
        ):
            tasks += [asyncio.create_task(self._attacker(kind, stop)) for _ in range(count)]
        if plan.wide_model:
            tasks.append(asyncio.create_task(self._wide(plan.wide_model, stop)))
        if plan.departing:
            tasks.append(asyncio.create_task(self._departing(stop)))
        await asyncio.gather(*tasks)
        self.result.open_at_end = dict(self._open)
        errors_after = await self._server_errors()
        if errors_before is not None and errors_after is not None:
            self.result.server_errors = errors_after - errors_before
        return self.result

    async def _attacker(self, kind: str, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(self.plan.host, self.plan.port)
            except OSError:
                await _wait(stop, 1.0)
                continue
            opened = time.monotonic()
            self._open[kind] = self._open.get(kind, 0) + 1
            closed_by_server = False
            try:
                closed_by_server = await self._hold(kind, reader, writer, stop)
            finally:
                self._open[kind] -= 1
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
            if closed_by_server:
                self.result.lifetimes.setdefault(kind, []).append(time.monotonic() - opened)

    async def _hold(
        self,
        kind: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        stop: asyncio.Event,
    ) -> bool:
        """Hold one connection the way ``kind`` does; whether the gateway closed it."""
        if kind == "slow_header":
            writer.write(SLOW_HEAD)
        elif kind == "trickle_body":
            writer.write(self._here(TRICKLE_HEAD))
        sent = 0
        tick = 0.5 if kind == "trickle_body" else 1.0
        while not stop.is_set():
            try:
                data = await asyncio.wait_for(reader.read(65536), tick)
            except TimeoutError:
                if kind == "slow_header":
                    writer.write(b"X-Drip: %d\r\n" % sent if sent % 8 == 0 else b"d")
                    sent += 1
                elif kind == "trickle_body" and sent < TRICKLE_LENGTH:
                    writer.write(b" ")
                    sent += 1
                continue
            except OSError:
                return True
            if not data:
                return True  # closed by the gateway (perhaps after a 408 or 431)
        return False

    async def _wide(self, model: str, stop: asyncio.Event) -> None:
        body = WIDE_BODY % model.encode()
        request = (
            b"POST /tokenize HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        ) + body
        request = self._here(request)
        while not await _wait(stop, 2.0):
            started = time.monotonic()
            try:
                answer = await asyncio.wait_for(self._probe(request), 30)
                status = answer.split(b" ", 2)[1].decode() if answer else "closed"
            except (TimeoutError, OSError) as exc:
                status = type(exc).__name__
            self.result.wide.append((time.monotonic() - started, status))

    async def _departing(self, stop: asyncio.Event) -> None:
        head = self._here(
            SLOW_HEAD + b"Content-Type: application/json\r\nContent-Length: 2000\r\n\r\n"
        )
        while not await _wait(stop, 0.2):
            try:
                _, writer = await asyncio.open_connection(self.plan.host, self.plan.port)
            except OSError:
                continue
            writer.write(head + b'{"model": "' + b"x" * 500)
            with contextlib.suppress(OSError):
                await writer.drain()
            writer.transport.abort()  # gone mid-body
            self.result.departed += 1

    async def _server_errors(self) -> float | None:
        """The 500s ``/metrics`` counts now (None: no metrics to read)."""
        key = self.plan.metrics_key
        auth = b"Authorization: Bearer %s\r\n" % key.encode() if key else b""
        request = b"GET /metrics HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n" + auth + b"\r\n"
        try:
            answer = await asyncio.wait_for(self._probe(request), 10)
        except (TimeoutError, OSError):
            return None
        if not answer.startswith(b"HTTP/1.1 200"):
            return None
        return sum(float(count) for count in _SERVER_ERRORS.findall(answer))

    async def _prober(self, stop: asyncio.Event) -> None:
        request = b"GET /health/live HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n"
        while not await _wait(stop, 0.5):
            self.result.probes += 1
            at = self.now()
            try:
                answer = await asyncio.wait_for(self._probe(request), self.plan.probe_timeout_s)
            except (TimeoutError, OSError) as exc:
                self.result.probe_failures.append((at, type(exc).__name__))
                continue
            if not answer.startswith(b"HTTP/1.1 200"):
                self.result.probe_failures.append((at, answer.split(b"\r\n", 1)[0].decode()))

    async def _probe(self, request: bytes) -> bytes:
        reader, writer = await asyncio.open_connection(self.plan.host, self.plan.port)
        try:
            writer.write(request)
            return await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()
