"""Kept-alive connections for the relayed requests, and the one retry a stale one earns.

Idle connections go back to a per-origin stack and are dropped when the upstream closes them
or after ``idle_timeout`` (below uvicorn's 5 s keep-alive, so we do not race the server's own
close). ``exchange`` sends a request and waits for the answer's head, on an idle connection if
there is one; how it fails tells the caller whether the request may be sent again.

A waiter cancelled mid-exchange (its client went away) cuts that connection: it is never
given back half-read, and the cut is what tells the engine to stop generating.
"""

from __future__ import annotations

import asyncio
import time

from loragate.http.connection import UpstreamBroken, UpstreamConnection, UpstreamSilent, connect
from loragate.http.wire import Origin, Target


class Unreachable(Exception):
    """Nothing listens at the origin: the request is safe to send again once it is back.

    ``detail`` says why when it is not the usual (refused, reset, no socket, timed out);
    ``maybe_delivered`` marks the one case where an earlier copy of the request may have
    reached the upstream before it died: that copy may be what killed it, so a caller resends
    such a request at most once.
    """

    def __init__(self, detail: str | None = None, *, maybe_delivered: bool = False) -> None:
        super().__init__(detail or "not reachable")
        self.detail = detail
        self.maybe_delivered = maybe_delivered


class Pool:
    def __init__(
        self,
        connect_timeout: float,
        idle_timeout: float,
        max_idle: int,
        silence_limit: float | None = None,
    ) -> None:
        """``silence_limit``: seconds an upstream may send nothing of an answer before its
        connection is cut (``UpstreamSilent``); None for no limit."""
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.max_idle = max_idle
        self.silence_limit = silence_limit
        self._idle: dict[Origin, list[UpstreamConnection]] = {}

    async def exchange(self, target: Target, request: bytes) -> UpstreamConnection:
        """Send ``request`` and wait for the answer's head; the connection is the caller's
        (to hand back with ``give_back``).

        Raises ``Unreachable`` when the request can be sent again, ``UpstreamBroken`` (or
        ``OSError``) when it may have been acted on, ``UpstreamSilent`` when no answer came
        in time.
        """
        conn = self._take_idle(target.origin)
        if conn is not None:
            conn.send(request, self.silence_limit)
            try:
                await conn.head()
                return conn
            except UpstreamSilent:
                conn.abort()
                raise
            except UpstreamBroken:
                conn.abort()
                if conn.got_bytes:
                    raise
                # A kept-alive connection the upstream closed just as we reused it: nothing
                # was answered, so send once more on a fresh connection. If that one cannot
                # even connect, the first attempt may still have reached the engine, so this
                # is not reported as "unreachable" (which the backend would resend)...
                try:
                    conn = await self._connect(target.origin)
                except (ConnectionRefusedError, FileNotFoundError) as exc:
                    # ...unless nothing listens any more: the engine died, taking whatever the
                    # first attempt started with it (generation has no side effects), so the
                    # backend may wait for the restart and send it again.
                    raise Unreachable(maybe_delivered=True) from exc
                except OSError as exc:
                    raise UpstreamBroken(f"the upstream went away: {exc}") from exc
                return await self._first_answer(conn, request)
            except BaseException:  # cancelled: the client left; the engine must stop too
                conn.abort()
                raise
        try:
            conn = await self._connect(target.origin)
        except (
            ConnectionRefusedError,
            ConnectionResetError,
            FileNotFoundError,
            TimeoutError,
        ) as exc:
            raise Unreachable() from exc
        except OSError as exc:
            raise Unreachable(str(exc.strerror or exc)) from exc
        return await self._first_answer(conn, request)

    async def _first_answer(self, conn: UpstreamConnection, request: bytes) -> UpstreamConnection:
        """Send ``request`` on a new connection and wait for the answer's head."""
        conn.send(request, self.silence_limit)
        try:
            await conn.head()
        except UpstreamSilent:
            conn.abort()
            raise
        except UpstreamBroken as exc:
            conn.abort()
            if conn.got_bytes:
                raise
            # A new connection cut before a byte of answer: the engine is dying (its listener
            # took the connection just before going). Like a refused one, but the request may
            # have reached the engine, so the backend resends it at most once.
            raise Unreachable(maybe_delivered=True) from exc
        except BaseException:
            conn.abort()
            raise
        return conn

    def _take_idle(self, origin: Origin) -> UpstreamConnection | None:
        stack = self._idle.get(origin)
        if not stack:
            return None
        oldest_ok = time.monotonic() - self.idle_timeout
        while stack:
            conn = stack.pop()
            if not conn.closed and conn.idle_since >= oldest_ok:
                return conn
            conn.abort()
        return None

    async def _connect(self, origin: Origin) -> UpstreamConnection:
        return await asyncio.wait_for(connect(origin), self.connect_timeout)

    def give_back(self, origin: Origin, conn: UpstreamConnection) -> None:
        if not conn.reusable:
            conn.abort()
            return
        stack = self._idle.setdefault(origin, [])
        if len(stack) >= self.max_idle:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        stack.append(conn)

    def close(self) -> None:
        for stack in self._idle.values():
            for conn in stack:
                conn.abort()
        self._idle.clear()
