"""Which hosts an image URL may point at: numeric forms read the way the OS reads them, and
every address that is this machine or not on the public internet refused."""

from __future__ import annotations

import functools
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence

from loragate.gateway.requests.media_pools import in_pool

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# host, port -> the addresses a connection to the host would use (strings, as getaddrinfo gives)
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

# Networks that embed an IPv4 address the packet may end up at: NAT64 (RFC 6052, 8215).
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))


def literal_address(host: str) -> IPAddress | None:
    """The address ``host`` stands for by itself, in any form the OS resolver accepts as a
    number (``127.0.0.1``, ``::1``, and inet_aton's ``0x7f000001``, ``2130706433``, ``127.1``,
    ``017700000001``, ``0``); None for a name."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except (OSError, ValueError):
        return None


def is_forbidden_address(address: IPAddress) -> bool:
    """Whether ``address`` is this machine or not on the public internet: loopback, private,
    link-local, unspecified, multicast, reserved or shared (CGNAT), also when wrapped in an
    IPv6 form (IPv4-mapped, 6to4, Teredo, NAT64)."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded: list[ipaddress.IPv4Address] = []
        if address.ipv4_mapped is not None:
            embedded.append(address.ipv4_mapped)
        if address.sixtofour is not None:
            embedded.append(address.sixtofour)
        if address.teredo is not None:
            embedded.extend(address.teredo)
        if any(address in network for network in _NAT64):
            embedded.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
        if any(is_forbidden_address(inner) for inner in embedded):
            return True
    return (
        not address.is_global
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
        or address.is_loopback
        or address.is_link_local
        or address.is_private
    )


def is_local_name(host: str) -> bool:
    host = host.strip("[]").rstrip(".").lower()
    return host == "localhost" or host.endswith(".localhost")


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses the OS resolver gives for ``host`` (getaddrinfo, in the DNS pool)."""
    infos = await in_pool(
        "dns", functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    )
    return [str(info[4][0]) for info in infos]
