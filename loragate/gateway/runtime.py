"""The gateway's runtime: settings, keys, metrics and the backend, shared by every route."""

from __future__ import annotations

import time
from typing import Any

from loragate.gateway.admin_token import new_admin_token
from loragate.gateway.auth import HasHeaders, KeyChecker
from loragate.gateway.backends.base import GatewayBackend
from loragate.gateway.cross_site import CrossSitePolicy, is_loopback
from loragate.gateway.errors import OpenAIError
from loragate.gateway.metrics import GatewayMetrics
from loragate.gateway.requests.chat import normalize_chat_request
from loragate.gateway.requests.parameters import Route, check_parameters
from loragate.settings import Settings

# Headers a reverse proxy adds: their presence means the client is not the peer we see.
_FORWARDING_HEADERS = (
    "forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "x-real-ip", "via"
)  # fmt: skip


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
            client_host is not None
            and is_loopback(client_host)
            and not any(name in request.headers for name in _FORWARDING_HEADERS)
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
        check_parameters(payload, route)  # max_tokens too: a positive integer by now
        cap = self.settings.max_tokens_cap
        for field in ("max_tokens", "max_completion_tokens"):
            value = payload.get(field)
            if value is not None and cap is not None and value > cap:
                raise OpenAIError(
                    400,
                    f"'{field}' is {value}, above this gateway's cap of {cap} (--max-tokens-cap)",
                    param=field,
                    code="max_tokens_too_large",
                )
