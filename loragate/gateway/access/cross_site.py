"""Requests from web pages: foreign origins, and host names that are not the gateway's.

A page in the user's browser can send requests to any address, the gateway's on loopback
included: GET, and POST with a text/plain, form or untyped body, need no CORS preflight. The
page cannot read the answers, but loading an adapter or restarting the engine needs none.
After a DNS rebinding, the page's own host name resolves to the gateway's address, so its
requests are even same-origin; they still name the attacker's host in ``Host``.

So a request that carries an ``Origin`` (browsers send one on every cross-origin request and
on every POST) must come from a listed CORS origin or from the gateway's own pages (``/ui``),
and admin requests must be addressed to one of the gateway's host names. CORS never applies
to the admin routes (``is_admin_path``): there only the gateway's own pages may send an
``Origin``, whatever ``--cors-origin`` lists (``*`` included), and no answer carries CORS
headers, so no other page may add an adapter, restart the engine or read the logs. So must inference
and model-list requests to a gateway without inference keys: after a rebinding they are
same-origin, and the page could read the model list and use the model. An address written
as digits (``192.168.1.5:8000``) is always fine there: a rebinding needs a name. JSON bodies must be
declared ``application/json`` (``requests.body``), which no page can send cross-origin without
a preflight. The health routes check none of this: a kubelet probes them by pod IP.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping

from loragate.gateway.errors import OpenAIError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})
# vLLM's adapter routes, which the gateway answers as admin routes (``routes/admin``).
_ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def is_admin_path(path: str) -> bool:
    """Whether ``path`` (inside the app) is an admin route's: CORS never applies to those."""
    return path == "/admin" or path.startswith("/admin/") or path in _ADMIN_PATHS


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(host: str) -> str:
    """The name in a ``Host`` header: ``Example.COM.:8000`` -> ``example.com``, ``[::1]:80`` -> ``::1``."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class CrossSitePolicy:
    """Which origins may send requests, and which host names admin requests may name."""

    def __init__(self, cors_origins: Iterable[str], allowed_hosts: Iterable[str], bind: str):
        origins = {origin.strip().lower().rstrip("/") for origin in cors_origins}
        self.any_origin = "*" in origins
        self.origins = frozenset(origins - {"*"})
        hosts = set(LOOPBACK_NAMES)
        if bind not in _WILDCARD_BINDS:
            hosts.add(host_name(bind))
        patterns = {host_name(host) for host in allowed_hosts}
        self.any_host = "*" in patterns
        self.host_suffixes = tuple(p[1:] for p in patterns if p.startswith("*."))
        self.hosts = frozenset(hosts | {p for p in patterns if not p.startswith("*")})

    def allows_host(self, name: str) -> bool:
        if self.any_host or name in self.hosts:
            return True
        return any(name.endswith(suffix) for suffix in self.host_suffixes)

    def check_origin(self, headers: Mapping[str, str], *, cors: bool = True) -> None:
        """403 for a request sent by a web page at a foreign origin; nothing without ``Origin``.

        Without ``cors`` (the admin routes), only the gateway's own pages may send one.
        """
        origin = headers.get("origin")
        if origin is None:
            return
        if cors and (self.any_origin or origin.lower().rstrip("/") in self.origins):
            return
        if self._is_own_origin(origin, headers.get("host")):
            return
        if not cors:
            raise OpenAIError(
                403,
                "Admin requests from web pages are refused unless the page is this gateway's "
                "own (--cors-origin does not apply to admin routes); use the gateway CLI, or "
                "send no Origin header.",
                code="origin_not_allowed",
            )
        raise OpenAIError(
            403,
            "Requests from web pages are refused unless the page's origin is allowed: "
            "pass --cors-origin ORIGIN to let that origin's pages call this gateway.",
            code="origin_not_allowed",
        )

    def check_host(self, headers: Mapping[str, str]) -> None:
        """403 for an admin request addressed to a host name that is not this gateway's."""
        host = headers.get("host")
        if host is None:  # browsers always send one; a client that sends none is no web page
            return
        name = host_name(host)
        if not self.allows_host(name):
            raise OpenAIError(
                403,
                f"This gateway's admin routes answer requests addressed to its own host names "
                f"only, not to {name[:100]!r}: if clients reach it by that name, pass "
                "--allowed-hosts NAME.",
                code="host_not_allowed",
            )

    def check_keyless_host(self, headers: Mapping[str, str]) -> None:
        """403 for an inference request to a gateway without inference keys, addressed to a
        host name that is not this gateway's (DNS rebinding); addresses always pass."""
        host = headers.get("host")
        if host is None:
            return
        name = host_name(host)
        if self.allows_host(name) or _is_address(name):
            return
        raise OpenAIError(
            403,
            f"This gateway has no API key, so it answers requests addressed to its own host "
            f"names or an IP address only, not to {name[:100]!r}: if clients reach it by that "
            "name, pass --allowed-hosts NAME (or give it an --api-key).",
            code="host_not_allowed",
        )

    def _is_own_origin(self, origin: str, host: str | None) -> bool:
        """Whether a page of this gateway sent the request (``/ui``), by a name it owns.

        The scheme is not compared: a proxy in front may end TLS. The name must be allowed,
        or a rebound page (``Origin`` and ``Host`` both the attacker's name) would pass.
        """
        if host is None or "://" not in origin:
            return False
        authority = origin.split("://", 1)[1].lower()
        return authority == host.strip().lower() and self.allows_host(host_name(host))
