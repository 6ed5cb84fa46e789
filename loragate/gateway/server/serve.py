"""``gateway serve``'s HTTP server: the app's life (ASGI lifespan), the listening socket, the
signals, and a graceful stop, read top to bottom in ``GatewayServer.run``.

loragate owns this server whole, on asyncio (uvloop where installed) and httptools, both used
through their public interfaces only: every guarantee of ``connection`` (deadlines, budgets,
requests counted, the hot routes) is code of this package, so no release of another project
can take one away or stop the gateway from starting. ``create_server()`` stays a plain ASGI
app that runs under any ASGI server (uvicorn, Hypercorn, Granian) with that server's limits.

The stop, on SIGTERM or SIGINT: stop listening, close idle connections, let requests in flight
finish for up to ``drain_timeout`` seconds (each connection closes after its answer), cancel
what is left, then the lifespan's shutdown (the engine's stop). A second signal cuts the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from loragate.gateway.server.connection import Connection, ServerState
from loragate.plan.preflight.host import bound_socket
from loragate.settings.request_limits import RequestLimitFields

log = logging.getLogger("loragate.gateway")

KEEP_ALIVE_SECONDS = 30.0
"""How long the gateway keeps an idle client connection open.

Longer than the idle time after which common clients stop reusing a pooled connection
(httpx and so the official ``openai`` SDK: 5 s; aiohttp: 15 s; Node's undici: 4 s). With the
same idle time on both sides, server and client expire one connection at the same moment, and
a request sent just as the server closes it fails with "Server disconnected without sending a
response": CI saw exactly that from an ``openai`` client with ``max_retries=0``."""

BACKLOG = 2048


class StartupFailed(RuntimeError):
    """The app's lifespan startup failed: the server does not listen."""


class Lifespan:
    """The ASGI lifespan protocol, driven for one app: ``startup`` then ``shutdown``."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._started = asyncio.Event()
        self._stopped = asyncio.Event()
        self._error: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._supported = True

    async def startup(self) -> None:
        self._task = asyncio.create_task(self._main())
        await self._inbox.put({"type": "lifespan.startup"})
        await self._started.wait()
        if self._error is not None:
            raise StartupFailed(self._error)

    async def shutdown(self) -> None:
        if self._task is None or self._task.done() or not self._supported:
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        await self._stopped.wait()
        if self._error is not None:
            log.error("the app's shutdown failed: %s", self._error)

    async def _main(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        try:
            await self.app(scope, self._inbox.get, self._send)
        except BaseException as exc:
            if not self._started.is_set():
                self._error = f"{type(exc).__name__}: {exc}"
                log.exception("the app failed to start")
            elif not self._stopped.is_set():
                self._error = f"{type(exc).__name__}: {exc}"
                log.exception("the app failed while stopping")
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self._started.set()
            self._stopped.set()

    async def _send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind in ("lifespan.startup.failed", "lifespan.shutdown.failed"):
            self._error = message.get("message") or kind
        if kind.startswith("lifespan.startup"):
            self._started.set()
        elif kind.startswith("lifespan.shutdown"):
            self._stopped.set()


class GatewayServer:
    """Serves one ASGI app (the gateway's, with its hot routes, when ``gateway`` is given)."""

    def __init__(
        self,
        app: Any,
        limits: RequestLimitFields,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        drain_timeout: float = 30.0,
        gateway: Any = None,
        keep_alive: float = KEEP_ALIVE_SECONDS,
    ) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.drain_timeout = drain_timeout
        self.state = ServerState(app=app, limits=limits, keep_alive=keep_alive, gateway=gateway)
        self.started = threading.Event()  # listening (for a server run in a thread)
        self.should_exit = False
        self._stop: asyncio.Event | None = None
        self._forced = False

    def run(self, *, install_signals: bool = True) -> None:
        """Serve until a signal (or ``request_stop``); blocks. uvloop when installed."""
        if importlib.util.find_spec("uvloop") is not None:
            import uvloop

            runner: Callable[..., Any] = uvloop.run
        else:
            runner = asyncio.run
        runner(self.serve(install_signals=install_signals))

    def request_stop(self) -> None:
        """Stop as a SIGTERM would (from any thread)."""
        self.should_exit = True
        loop, stop = getattr(self, "_loop", None), self._stop
        if loop is not None and stop is not None:
            loop.call_soon_threadsafe(stop.set)

    async def serve(self, *, install_signals: bool = True) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._stop = asyncio.Event()
        if self.should_exit:
            self._stop.set()
        if install_signals:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, self._on_signal, signum)
        # Listening before the app starts: a client that connects once systemd has heard
        # READY=1 (sent from the app's startup) waits in the backlog, never refused, and a
        # port that cannot be had fails the start before anything is started or announced.
        try:
            sock = bound_socket(self.host, self.port)
            sock.listen(BACKLOG)
        except OSError as exc:
            log.error("cannot listen on %s:%s: %s", self.host, self.port, exc)
            raise
        lifespan = Lifespan(self.app)
        try:
            await lifespan.startup()
        except BaseException:
            sock.close()
            raise
        try:
            server = await loop.create_server(
                lambda: Connection(self.state), sock=sock, backlog=BACKLOG
            )
        except OSError as exc:
            log.error("cannot serve on %s:%s: %s", self.host, self.port, exc)
            sock.close()
            await lifespan.shutdown()
            raise
        self.port = int(sock.getsockname()[1])  # the one the kernel chose, for port 0
        log.info("listening on http://%s:%s", _display_host(self.host), self.port)
        self.started.set()
        try:
            await self._stop.wait()
        finally:
            await self._drain(server)
            await lifespan.shutdown()
            if install_signals:
                for signum in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(signum)
        log.info("stopped")

    def _on_signal(self, signum: int) -> None:
        if self._stop is not None and self._stop.is_set():
            self._forced = True  # a second signal: stop waiting for requests in flight
            log.warning("%s again: not waiting for requests in flight", signal.Signals(signum).name)
            return
        log.info("%s: stopping", signal.Signals(signum).name)
        self.should_exit = True
        if self._stop is not None:
            self._stop.set()

    async def _drain(self, server: asyncio.AbstractServer) -> None:
        state = self.state
        state.shutting_down = True
        server.close()
        for conn in list(state.connections):
            conn.shutdown()
        deadline = asyncio.get_running_loop().time() + self.drain_timeout
        if state.tasks:
            log.info(
                "waiting up to %g s for %d requests in flight", self.drain_timeout, state.active
            )
        while state.tasks and not self._forced:
            if asyncio.get_running_loop().time() >= deadline:
                log.warning("%d requests still in flight after %g s: cancelled",
                            state.active, self.drain_timeout)  # fmt: skip
                break
            await asyncio.sleep(0.05)
        for task in list(state.tasks):
            task.cancel()
        for conn in list(state.connections):
            conn.transport.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 2)


def _display_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def serve_app(app: Any, settings: Any) -> None:
    """Run ``gateway serve``'s server for ``app`` with ``settings`` until a signal stops it."""
    gateway = getattr(getattr(app, "state", None), "gateway", None)
    hot = gateway is not None and not settings.cors_origins
    if gateway is not None and settings.cors_origins:
        log.info("CORS is on: the inference routes go through the app (its CORS headers)")
    GatewayServer(
        app,
        settings,
        host=settings.host,
        port=settings.port,
        drain_timeout=settings.drain_timeout,
        gateway=gateway if hot else None,
    ).run()
