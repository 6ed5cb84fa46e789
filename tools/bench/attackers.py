"""Attackers for the soak: connections that hold the gateway's sockets without being requests.

Two kinds, each of which took every route down before the gateway had connection deadlines
(issue 24): *idle* sockets that connect and send nothing, and *slow-header* clients that send a
request line and then one header byte a second. Each reopens as soon as the gateway closes it, so the pressure is
constant for the whole soak. Beside them a *liveness prober* asks ``/health/live`` every half
second on a fresh connection, as the kubelet does, with a short timeout.

The verdict: every probe answered 200, and every attacker's connection was closed by the
gateway within the head deadline. What an attacker saw is kept as connection lifetimes. (A
client that never reads its answer is closed by the write deadline; from the client's side that
close is not visible until it reads, so ``tests/unit/test_connection_hygiene.py`` pins it from
the gateway's side instead.)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any

SLOW_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\n"


@dataclass
class AttackPlan:
    host: str
    port: int
    idle: int = 128  # idle sockets held at once
    slow_headers: int = 4
    head_deadline_s: float = 20.0  # the gateway's header deadline, with slack
    probe_timeout_s: float = 3.0


@dataclass
class AttackResult:
    plan: AttackPlan
    lifetimes: dict[str, list[float]] = field(default_factory=dict)  # kind -> closed by server
    open_at_end: dict[str, int] = field(default_factory=dict)  # kind -> still open at the stop
    probes: int = 0
    probe_failures: list[tuple[float, str]] = field(default_factory=list)

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
            bound = plan.head_deadline_s
            late = [t for t in lifetimes if t > bound]
            if late:
                problems.append(
                    f"{len(late)} {kind} connections lived past {bound:g} s (longest "
                    f"{max(late):.1f} s)"
                )
        for kind, wanted in (("idle", plan.idle), ("slow_header", plan.slow_headers)):
            if wanted and not self.lifetimes.get(kind):
                problems.append(f"the gateway never closed an {kind} connection")
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

    async def run(self, stop: asyncio.Event) -> AttackResult:
        plan = self.plan
        tasks = [asyncio.create_task(self._prober(stop))]
        tasks += [asyncio.create_task(self._attacker("idle", stop)) for _ in range(plan.idle)]
        tasks += [
            asyncio.create_task(self._attacker("slow_header", stop))
            for _ in range(plan.slow_headers)
        ]
        await asyncio.gather(*tasks)
        self.result.open_at_end = dict(self._open)
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
        sent = 0
        while not stop.is_set():
            try:
                data = await asyncio.wait_for(reader.read(65536), 1.0)
            except TimeoutError:
                if kind == "slow_header":
                    writer.write(b"X-Drip: %d\r\n" % sent if sent % 8 == 0 else b"d")
                    sent += 1
                continue
            except OSError:
                return True
            if not data:
                return True  # closed by the gateway (perhaps after a 408 or 431)
        return False

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
