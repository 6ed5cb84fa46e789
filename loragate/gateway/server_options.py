"""The uvicorn options ``gateway serve`` runs the app with (the hot protocol among them).

Above ``runtime`` and ``hot_protocol`` in the import graph: it picks the protocol for a
``Gateway``, so neither of them needs the other's module to do it.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

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

    uvicorn's fastest event loop and HTTP parser, where they are installed (the ``fast``
    extra): uvloop and httptools roughly halve the time uvicorn itself spends per request.
    Given the gateway's ``app`` (and CORS off), the HTTP protocol is ``hot_protocol``:
    uvicorn's, with the inference POSTs answered without ASGI; and its connections are bounded
    (``limit_concurrency``). uvicorn's X-Forwarded-For middleware is left out: the gateway
    uses the client's address only to keep ``open_admin`` to loopback clients, and a proxy's
    header must not fake that. Idle connections stay open ``KEEP_ALIVE_SECONDS``.
    """
    options: dict[str, Any] = {"proxy_headers": False, "timeout_keep_alive": KEEP_ALIVE_SECONDS}
    gateway = getattr(getattr(app, "state", None), "gateway", None)
    if isinstance(gateway, Gateway):
        options["limit_concurrency"] = gateway.settings.limit_concurrency
    if importlib.util.find_spec("uvloop") is not None:
        options["loop"] = "uvloop"
    if importlib.util.find_spec("httptools") is not None:
        options["http"] = "httptools"
        # The hot protocol answers inference POSTs ahead of every middleware: CORS must see them.
        if isinstance(gateway, Gateway) and not gateway.settings.cors_origins:
            if fits_this_uvicorn():
                options["http"] = hot_protocol(gateway)
            else:
                logging.getLogger("loragate.gateway").warning(
                    "this uvicorn's HTTP protocol differs from the one loragate's hot path was "
                    "built on; serving every route through ASGI (slower, same answers)"
                )
    return options
