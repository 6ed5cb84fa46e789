"""``create_app``: the FastAPI application, its routes, error shapes and life cycle."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from loragate.gateway.access.admin_token import (
    publish_admin_token,
    status_page_url,
    withdraw_admin_token,
)
from loragate.gateway.access.auth import KeyConfigError, check_key_settings
from loragate.gateway.access.cross_site import is_admin_path, is_loopback
from loragate.gateway.access.security_headers import SecurityHeaders
from loragate.gateway.backends.base import GatewayBackend
from loragate.gateway.backends.custom import InferenceBackend
from loragate.gateway.backends.custom_adapter import as_gateway_backend
from loragate.gateway.errors import OpenAIError, install_error_handlers
from loragate.gateway.observe import metrics_scrape
from loragate.gateway.observe.log_tail import recent_gateway_log
from loragate.gateway.observe.metrics import RequestObserver, route_path
from loragate.gateway.observe.spans import enable_spans
from loragate.gateway.openapi_schemas import install_openapi
from loragate.gateway.routes import admin, health, inference, passthrough, status, ui
from loragate.gateway.runtime import Gateway
from loragate.settings import Settings
from loragate.systemd import SystemdReporter

log = logging.getLogger("loragate.gateway")


class BackendLifecycle:
    """Starts and stops the backend, publishes the per-start admin token with it, and tells
    systemd how the process's life goes (``SystemdReporter``: for every kind of backend).

    The app's lifespan drives it. An app that gets no lifespan events (mounted in another app:
    Starlette's ``Mount`` passes none on; or served with lifespan off) starts its backend on
    its first request instead. It then stops only if the parent's lifespan runs this app's
    (``gateway.router.lifespan_context(gateway)``, docs/api.md "Embedding: any ASGI server, or
    mounted in a larger app").
    """

    def __init__(self, gateway: Gateway, inference_keys: int) -> None:
        self.gateway = gateway
        self.inference_keys = inference_keys
        self.started = False
        self.stopped = False
        self._lock = asyncio.Lock()
        self.systemd = SystemdReporter()

    async def start(self, *, on_request: bool = False) -> None:
        async with self._lock:
            if self.started:
                return
            if on_request and self.stopped:
                raise OpenAIError(503, "the gateway has stopped", code="gateway_stopped")
            if on_request:
                log.warning(
                    "starting the backend on the first request: this app got no lifespan "
                    "events (mounted in another app, or lifespan off); run its lifespan from "
                    "the parent's so that it also stops cleanly"
                )
            gateway, settings = self.gateway, self.gateway.settings
            token = gateway.admin_token
            if token is None and settings.admin_key is None:
                log.warning("admin routes are open without a key to clients on this machine")
            if self.inference_keys:
                log.info("inference routes need one of %d API keys", self.inference_keys)
            else:
                log.info("inference routes are open: no --api-key or --api-key-file was given")
            self.systemd.starting(gateway.backend)
            try:
                await gateway.backend.start()
            except BaseException:
                await self.systemd.stop()
                raise
            self.systemd.started()
            if token is not None:
                path = publish_admin_token(settings.cache_dir, token)
                log.info("admin routes need the per-start token in %s (no --admin-key given)", path)
                if sys.stderr.isatty():
                    # To the terminal only (Jupyter's start line): never into a log, journald
                    # or /admin/logs, whose readers are not all the cache dir's.
                    url = status_page_url(settings.host, settings.port, token)
                    print(f"status page: {url}", file=sys.stderr, flush=True)
            self.started, self.stopped = True, False

    async def stop(self) -> None:
        async with self._lock:
            if not self.started:
                return
            self.started, self.stopped = False, True
            token = self.gateway.admin_token
            if token is not None:
                withdraw_admin_token(self.gateway.settings.cache_dir, token)
            await self.systemd.stop()
            await self.gateway.backend.stop()


class GatewayApp(FastAPI):
    """FastAPI, starting its backend on the first request when it got no lifespan events.

    The inference POST routes are plain Starlette routes here (no dependency solving); under
    ``gateway serve`` they never reach this app: ``server.hot_routes`` answers them on the
    gateway server's own connections (``loragate/gateway/server/``).
    """

    lifecycle: BackendLifecycle | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lifecycle = self.lifecycle
        if lifecycle is not None and not lifecycle.started and scope["type"] == "http":
            try:
                await lifecycle.start(on_request=True)
            except OpenAIError as exc:
                await exc.response()(scope, receive, send)
                return
            except Exception:
                log.exception("the gateway could not start its backend")
                error = OpenAIError(
                    503,
                    "the gateway could not start its backend; see its log",
                    code="backend_unavailable",
                )
                await error.response()(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


metrics_router = APIRouter()


@metrics_router.get("/metrics")
async def scrape(request: Request) -> Response:
    """Prometheus text, public unless ``metrics_public`` is off (then the admin key)."""
    gateway: Gateway = request.app.state.gateway
    if not gateway.settings.metrics_public:
        gateway.check_admin_key(request, request.client.host if request.client else None)
    return Response(await metrics_scrape.render(gateway), media_type=metrics_scrape.CONTENT_TYPE)


class AdminKeyRequired(KeyConfigError):
    pass


class CORSBesideAdmin(CORSMiddleware):
    """CORS for every route but the admin routes (``cross_site.is_admin_path``): their
    preflights and answers pass by untouched, so no page at a ``--cors-origin`` (nor at
    any origin, with ``*``) is told it may call them or read their answers."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_admin_path(route_path(scope)):
            await self.app(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def create_app(
    settings: Settings, backend: GatewayBackend | InferenceBackend | None = None
) -> FastAPI:
    """Build the gateway app.

    ``backend`` may be an ``InferenceBackend`` (wrapped) or a ``GatewayBackend``. Without one,
    the app proxies ``settings.upstream_url`` when set, and otherwise supervises a vLLM engine
    on ``settings.model`` (or the Vi run, or the demo when ``settings.demo`` asks for it;
    ``NoModelError`` when none is named).
    """
    if settings.admin_key is None and not is_loopback(settings.host):
        raise AdminKeyRequired(
            f"the gateway listens on {settings.host}, beyond loopback, but no admin key is set: "
            "pass --admin-key KEY (or LORAGATE_ADMIN_KEY) so nobody else can change adapters"
        )
    inference_keys = check_key_settings(settings)
    if backend is not None:
        backend = as_gateway_backend(backend)
    elif settings.upstream_url is not None:
        from loragate.gateway.backends.upstream import UpstreamBackend

        backend = UpstreamBackend(settings)
    else:
        from loragate.gateway.backends.managed import managed_backend
        from loragate.plan.engine_plan import require_model

        if not settings.models:
            require_model(settings)  # the demo only when asked for, never as a fallback
        backend = managed_backend(settings)
    enable_spans(settings)  # imports OpenTelemetry only when an endpoint is set
    gateway = Gateway(settings, backend)
    lifecycle = BackendLifecycle(gateway, len(inference_keys))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await lifecycle.start()
        try:
            yield
        finally:
            await lifecycle.stop()

    # FastAPI's /docs and /redoc load their viewers from a CDN: a plain page instead
    # (``openapi_schemas.DOCS_PAGE``).
    app = GatewayApp(
        title="loragate",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json" if settings.docs else None,
    )
    app.state.gateway = gateway
    app.lifecycle = lifecycle
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(inference.router)
    app.include_router(passthrough.router)
    app.include_router(admin.router)
    app.include_router(metrics_router)
    # The status page (/ui), and what it reads beyond the admin API.
    app.include_router(status.admin_router)
    app.include_router(status.router)
    app.include_router(ui.router)
    recent_gateway_log()  # from now on, so the page's log tail starts with the boot
    install_openapi(app, docs_page=settings.docs)
    app.add_middleware(SecurityHeaders)
    if settings.cors_origins:
        app.add_middleware(
            CORSBesideAdmin,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "PUT", "DELETE", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "X-Request-ID"],
        )
    # Outermost, so request durations include every other middleware.
    access_log = settings.access_log
    app.add_middleware(RequestObserver, metrics=gateway.metrics, access_log_enabled=access_log)
    return app
