"""The gateway's runtime: settings, keys, metrics and the backend, shared by every route."""

from __future__ import annotations

import time
from typing import Any

from loragate.gateway.access.admin_token import new_admin_token
from loragate.gateway.access.auth import HasHeaders, KeyChecker
from loragate.gateway.access.cross_site import CrossSitePolicy, is_loopback
from loragate.gateway.backends.base import GatewayBackend
from loragate.gateway.errors import OpenAIError
from loragate.gateway.generation_routes import BY_KIND, BY_PATH, Route
from loragate.gateway.observe.metrics import GatewayMetrics
from loragate.gateway.requests.chat import normalize_chat_request
from loragate.gateway.requests.parameters import check_parameters
from loragate.gateway.requests.presets import CapFill
from loragate.settings import Settings

# Headers a proxy adds to say whom it forwards for: their presence means the client is not the
# peer we see. A proxy that adds none (nginx's plain proxy_pass, socat, ssh -L) cannot be told
# from a local client: docs/security.md says so beside --open-admin.
_FORWARDING_HEADERS = frozenset({
    "forwarded", "via", "x-real-ip", "x-client-ip", "client-ip", "true-client-ip",
    "cf-connecting-ip", "fastly-client-ip", "x-cluster-client-ip", "x-proxyuser-ip",
    "wl-proxy-client-ip", "proxy-client-ip", "x-envoy-external-address",
})  # fmt: skip
_FORWARDING_PREFIXES = ("x-forwarded-", "x-original-")  # X-Forwarded-For, X-Original-URI, ...


def _is_forwarded(request: HasHeaders) -> bool:
    return any(
        name.lower() in _FORWARDING_HEADERS or name.lower().startswith(_FORWARDING_PREFIXES)
        for name in request.headers
    )


class Gateway:
    def __init__(self, settings: Settings, backend: GatewayBackend) -> None:
        self.settings = settings
        self.backend = backend
        # Without an admin key, a per-start token is one (published at start: admin_token.py),
        # unless open admin routes were asked for.
        self.admin_token: str | None = None
        if settings.admin_key is None and not settings.open_admin:
            self.admin_token = new_admin_token()
        self.keys = KeyChecker(
            settings.inference_keys(),
            settings.admin_key or self.admin_token,
            per_start_token=self.admin_token is not None,
        )
        self.cross_site = CrossSitePolicy(
            settings.cors_origins, settings.allowed_hosts, settings.host
        )
        self.started_at = time.time()
        self.metrics = GatewayMetrics()

    def admit_admin(self, request: HasHeaders, client_host: str | None) -> None:
        """Where an admin request comes from, then its key: a web page gets no further than
        the cross-site checks (``cross_site``)."""
        self.cross_site.check_origin(request.headers, cors=False)
        self.cross_site.check_host(request.headers)
        self.check_admin_key(request, client_host)

    def check_admin_key(self, request: HasHeaders, client_host: str | None) -> None:
        """The admin key; where admin routes are open (``open_admin``), a client on this machine.

        A request a proxy forwarded is not from this machine, even when the proxy runs here.
        """
        if self.keys.admin_open and not (
            client_host is not None and is_loopback(client_host) and not _is_forwarded(request)
        ):
            raise OpenAIError(
                403,
                "This gateway's admin routes are open without a key to clients on its own "
                "machine only; start it with --admin-key KEY to administer it from elsewhere.",
                code="invalid_admin_key",
            )
        self.keys.check_admin(request)

    async def chat_request(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Check a chat request and bring it to OpenAI's shape (Vi requests included)."""
        payload = await normalize_chat_request(payload, self.settings)
        self.check_generation_limits(payload, "chat")
        return payload

    def check_generation_limits(
        self, payload: dict[str, Any], route: Route = "completions"
    ) -> None:
        check_parameters(payload, route)  # the token fields are integers by now
        self.cap_tokens(BY_KIND[route].path, payload)

    def cap_tokens(self, path: str, payload: dict[str, Any]) -> None:
        """``--max-tokens-cap`` on a request to the generation route ``path``, in place: a token
        limit or ``min_tokens`` above the cap is a 400; a request that asks no limit gets the
        cap as its limit (a completion: vLLM's 16, when lower), as a ``CapFill``: a version's
        preset may set its own in its place, within the cap. Other routes pass untouched."""
        cap = self.settings.max_tokens_cap
        route = BY_PATH.get(path)  # ``generation_routes``: each route's token fields
        if cap is None or route is None:
            return
        limits, floor = route.token_limits, route.min_tokens
        for field in (*limits, floor) if floor else limits:
            value = payload.get(field)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                # vLLM's models read "100000" and 1e5 as numbers: refused, not let past the cap.
                raise OpenAIError(
                    400, f"'{field}' must be an integer", param=field, code="invalid_type"
                )
            if value > cap:
                raise OpenAIError(
                    400,
                    f"'{field}' is {value}, above this gateway's cap of {cap} (--max-tokens-cap)",
                    param=field,
                    code="min_tokens_too_large" if field == floor else "max_tokens_too_large",
                )
        if not route.fills_limit or any(payload.get(field) is not None for field in limits):
            return
        fill = cap
        if route.engine_default is not None and limits[0] not in payload:  # null asks no limit
            fill = min(cap, route.engine_default)
        payload[limits[0]] = CapFill(fill, cap)
