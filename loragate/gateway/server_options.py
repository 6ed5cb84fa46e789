"""The uvicorn options ``gateway serve`` runs the app with (the hot protocol among them).

Above ``runtime``, ``connection_guard`` and ``hot_protocol`` in the import graph: it picks the
protocol for a ``Gateway``, so none of them needs another's module to do it.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from loragate.gateway.connection_guard import GuardedProtocol
from loragate.gateway.hot_protocol import hot_protocol
from loragate.gateway.runtime import Gateway
from loragate.gateway.uvicorn_fit import (
    TESTED_ON,
    UVICORN_VERSION,
    UnfitUvicorn,
    fast_path_unfit,
    guard_unfit,
)

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

    Which path serves is said in one log line (``uvicorn_fit`` decides what this uvicorn
    allows): the fast path; or plain ASGI, and why (CORS on, or this uvicorn's internals
    differ from those the fast path was checked on). A uvicorn the connection guard cannot
    hook into raises ``UnfitUvicorn`` instead: serving without its deadlines would leave the
    gateway open to slow and idle clients, and nobody would notice.
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
    unfit = guard_unfit()
    if unfit is not None:
        raise UnfitUvicorn(
            f"loragate's connection guard (header, body and write deadlines, header budget, "
            f"--limit-concurrency per request) cannot run on uvicorn {UVICORN_VERSION}: "
            f"{unfit}; install one it was checked on (pip install 'uvicorn=={TESTED_ON[-1]}')"
        )
    settings = gateway.settings
    log = logging.getLogger("loragate.gateway")
    options["ws"] = "none"
    # The hot protocol answers inference POSTs ahead of every middleware: CORS must see them.
    if settings.cors_origins:
        reason: str | None = "CORS is on (its headers come from the ASGI middleware)"
    else:
        reason = fast_path_unfit()
    if reason is None:
        options["http"] = hot_protocol(gateway)
        log.info("serving the inference routes on the fast path (uvicorn %s)", UVICORN_VERSION)
        return options
    options["http"] = GuardedProtocol.bound_to(settings)
    log.log(
        logging.INFO if settings.cors_origins else logging.WARNING,
        "serving every route through plain ASGI behind the connection guard, not the fast "
        "path (slower, the same answers): %s",
        reason if settings.cors_origins else f"uvicorn {UVICORN_VERSION}'s {reason}",
    )
    return options
