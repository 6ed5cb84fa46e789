"""Where adapter downloads may connect: public addresses, and the private networks the
operator named (``allowed_source_networks``).

An adapter source, the fleet manifest URL and a hub endpoint come from an admin call, a
manifest or the environment; none of them may make the gateway fetch from its own loopback,
the cloud metadata service (169.254.169.254) or a private network nobody allowed. Every
connection goes through ``source_client``: each hop (redirects included) is resolved once
when the connection opens, every answer is checked (``loragate.http.addresses``, the image
check's classifier) and the socket goes to the checked address, with the name kept for TLS,
so an answer that changes between check and connect (DNS rebinding) changes nothing. Through
an ``HTTP(S)_PROXY`` the proxy resolves the name: there each request's host is checked just
before it is sent.

The allow-list is the process's (one gateway, one policy): ``wiring`` sets it from the
settings when it builds the adapter layer.
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.request
from collections.abc import Iterable
from typing import Any

import httpx

from loragate.http.addresses import AllowedNetworks, IPAddress, literal_address

_allowed = AllowedNetworks()


def allow_source_networks(allowed: AllowedNetworks) -> None:
    """Let every later source download reach ``allowed`` (replacing the list before)."""
    global _allowed
    _allowed = allowed


def allowed_source_networks() -> AllowedNetworks:
    return _allowed


class SourceAddressRefused(ValueError):
    """A source URL points at an address the operator did not allow; the message says how."""


def _refusal(host: str, found: IPAddress | str) -> SourceAddressRefused:
    shown = f"{host} ({found})" if str(found) != host else host
    return SourceAddressRefused(
        f"{shown} is a loopback, private or link-local address, which adapter downloads may "
        "not reach; allow its network with --allowed-source-networks (allowed_source_networks, "
        "e.g. 10.0.0.0/8 or the host name) if it is one of your own artifact stores"
    )


def _addresses(host: str, port: int) -> list[IPAddress]:
    literal = literal_address(host)
    if literal is not None:
        return [literal]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise _Unresolvable(f"cannot resolve {host}: {exc}") from exc
    return [ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in infos]


def checked_addresses(host: str, port: int, allowed: AllowedNetworks) -> list[IPAddress]:
    """The addresses ``host`` resolves to, all allowed; ``SourceAddressRefused`` if one is not."""
    addresses = [] if allowed.allows_host(host) else _addresses(host, port)
    found = allowed.refused(host, addresses)
    if found is not None:
        raise _refusal(host, found)
    return addresses


def check_source_url(url: str) -> None:
    """Refuse ``url`` now if its host is or resolves to an address off the allow-list: for
    endpoints another library connects to (a hub, a proxy's target)."""
    target = httpx.URL(url)
    port = target.port or (443 if target.scheme == "https" else 80)
    try:
        if target.host:
            checked_addresses(target.host, port, _allowed)
    except _Unresolvable:
        pass  # not resolvable here: that library (or the proxy) resolves it, or fails, itself


class _Unresolvable(OSError):
    """A host name that does not resolve here (another library may resolve it itself)."""


def _checking_transport(allowed: AllowedNetworks) -> httpx.HTTPTransport:
    """httpx's transport whose every connection goes only to an address just checked.

    httpcore is imported here, not with the module: the gateway imports this module at start-up
    (for the allow-list) and must stay light; only a download needs the transport."""
    import httpcore

    class _CheckingBackend(httpcore.NetworkBackend):
        """httpcore's own sockets, opened only to an address just checked."""

        def __init__(self, allowed: AllowedNetworks) -> None:
            self._inner = httpcore.SyncBackend()
            self._allowed = allowed

        def connect_tcp(
            self,
            host: str,
            port: int,
            timeout: float | None = None,
            local_address: str | None = None,
            socket_options: Iterable[Any] | None = None,
        ) -> httpcore.NetworkStream:
            try:
                addresses = checked_addresses(host, port, self._allowed)
            except _Unresolvable as exc:
                raise httpcore.ConnectError(str(exc)) from exc
            target = str(addresses[0]) if addresses else host  # a host the operator allowed by name
            return self._inner.connect_tcp(target, port, timeout, local_address, socket_options)

        def connect_unix_socket(
            self,
            path: str,
            timeout: float | None = None,
            socket_options: Iterable[Any] | None = None,
        ) -> httpcore.NetworkStream:
            return self._inner.connect_unix_socket(path, timeout, socket_options)

        def sleep(self, seconds: float) -> None:
            self._inner.sleep(seconds)

    class _CheckingTransport(httpx.HTTPTransport):
        def __init__(self, allowed: AllowedNetworks) -> None:
            super().__init__()
            # httpx takes no network backend of its own: the same pool as its default, with one.
            self._pool = httpcore.ConnectionPool(
                ssl_context=httpx.create_ssl_context(),
                max_connections=100,
                max_keepalive_connections=20,
                keepalive_expiry=5.0,
                network_backend=_CheckingBackend(allowed),
            )

    return _CheckingTransport(allowed)


def _check_request(request: httpx.Request) -> None:
    check_source_url(str(request.url))


def source_client(timeout: float, *, follow_redirects: bool = True) -> httpx.Client:
    """An httpx client for adapter sources: every connection checked against the allow-list."""
    if set(urllib.request.getproxies_environment()) - {"no"}:
        # The proxy connects for us: check each request's host (every hop) before it goes.
        return httpx.Client(
            timeout=httpx.Timeout(timeout),
            follow_redirects=follow_redirects,
            event_hooks={"request": [_check_request]},
        )
    return httpx.Client(
        timeout=httpx.Timeout(timeout),
        follow_redirects=follow_redirects,
        transport=_checking_transport(_allowed),
    )
