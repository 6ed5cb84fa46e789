"""The uvicorn options ``gateway serve`` runs the app with (the hot protocol among them).

Above ``runtime``, ``connection_guard`` and ``hot_protocol`` in the import graph: it picks the
protocol for a ``Gateway``, so none of them needs another's module to do it.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from loragate.gateway import connection_guard
from loragate.gateway.connection_guard import GuardedProtocol
from loragate.gateway.hot_protocol import fits_this_uvicorn, hot_protocol
from loragate.gateway.runtime import Gateway

KEEP_ALIVE_SECONDS = 30.0
"""How long the gateway keeps an idle client connection open (uvicorn's default is 5 s).

Longer than the idle time after which common clients stop reusing a pooled connection
(httpx and so the official ``openai`` SDK: 5 s; aiohttp: 15 s; Node's undici: 4 s). With
uvicorn's 5 s, server and client expire the same connection at the same moment, and a
request sent just as the server closes it fails with "Server disconnected without sending a
response": CI saw exactly that from an ``openai`` client with ``max_retries=0``."""


def server_options(app: Any = None) -> dict[str, Any]:
    """The uvicorn options ``gateway serve`` runs ``app`` with.

    uvicorn's fastest event loop and HTTP parser (uvloop where installed, httptools). Given the
    gateway's ``app``, the HTTP protocol is ``connection_guard``'s (deadlines for a request's
    headers, body and the client's reading, a header budget, ``limit_concurrency`` counted in
    requests: uvicorn's own limit, which counts idle sockets too, is left off), and with CORS
    off ``hot_protocol``'s, the same guard with the inference POSTs answered without ASGI.
    No websocket protocol: the gateway has no websocket route, and an upgraded connection
    would leave the guard. uvicorn's X-Forwarded-For middleware is left out: the gateway
    uses the client's address only to keep ``open_admin`` to loopback clients, and a proxy's
    header must not fake that. Idle connections stay open ``KEEP_ALIVE_SECONDS``.
    """
    options: dict[str, Any] = {
        "proxy_headers": False,
        "timeout_keep_alive": KEEP_ALIVE_SECONDS,
        "http": "httptools",
    }
    if importlib.util.find_spec("uvloop") is not None:
        options["loop"] = "uvloop"
    gateway = getattr(getattr(app, "state", None), "gateway", None)
    if not isinstance(gateway, Gateway):
        return options
    settings = gateway.settings
    log = logging.getLogger("loragate.gateway")
    if not connection_guard.fits_this_uvicorn():
        log.warning(
            "this uvicorn's HTTP protocol differs from the one loragate's connection guard was "
            "built on: no header, body or write deadlines, and --limit-concurrency counts "
            "connections (uvicorn's own limit)"
        )
        options["limit_concurrency"] = settings.limit_concurrency
        return options
    options["ws"] = "none"
    # The hot protocol answers inference POSTs ahead of every middleware: CORS must see them.
    if settings.cors_origins:
        options["http"] = GuardedProtocol.bound_to(settings)
    elif fits_this_uvicorn():
        options["http"] = hot_protocol(gateway)
    else:
        log.warning(
            "this uvicorn's request cycle differs from the one loragate's hot path was built "
            "on; serving every route through ASGI (slower, same answers)"
        )
        options["http"] = GuardedProtocol.bound_to(settings)
    return options
