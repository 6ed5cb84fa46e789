"""Which hosts the gateway may connect to on a client's or a source's behalf: numeric forms
read the way the OS reads them, and every address that is this machine or not on the public
internet refused unless the operator named its network.

Shared by the gateway (image URLs in requests) and the adapters (archive URLs, the fleet
manifest, hub endpoints): a URL that arrives from outside must not reach the metadata service
(169.254.169.254), the engine's own port or anything else behind the host's firewall.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

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


def embedded_ipv4(address: IPAddress) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 ``address`` wraps (IPv4-mapped, 6to4, Teredo, NAT64)."""
    if not isinstance(address, ipaddress.IPv6Address):
        return []
    embedded: list[ipaddress.IPv4Address] = []
    if address.ipv4_mapped is not None:
        embedded.append(address.ipv4_mapped)
    if address.sixtofour is not None:
        embedded.append(address.sixtofour)
    if address.teredo is not None:
        embedded.extend(address.teredo)
    if any(address in network for network in _NAT64):
        embedded.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return embedded


def is_forbidden_address(address: IPAddress) -> bool:
    """Whether ``address`` is this machine or not on the public internet: loopback, private,
    link-local, unspecified, multicast, reserved or shared (CGNAT), also when wrapped in an
    IPv6 form (IPv4-mapped, 6to4, Teredo, NAT64)."""
    if any(is_forbidden_address(inner) for inner in embedded_ipv4(address)):
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


@dataclass(frozen=True)
class AllowedNetworks:
    """The private networks and host names an operator let sources reach (CIDRs such as
    ``10.0.0.0/8``, or exact host names such as ``artifacts.internal``); empty: none."""

    networks: tuple[IPNetwork, ...] = ()
    hosts: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> AllowedNetworks:
        """The allow-list ``entries`` name; ``ValueError`` naming an entry that is neither a
        network nor a host name."""
        networks: list[IPNetwork] = []
        hosts: set[str] = set()
        for entry in entries:
            text = entry.strip()
            try:
                networks.append(ipaddress.ip_network(text, strict=False))
                continue
            except ValueError:
                pass
            name = text.rstrip(".").lower()
            labels = name.split(".")
            if not name or not all(label and label.replace("-", "").isalnum() for label in labels):
                raise ValueError(
                    f"{entry!r} is neither a network (such as 10.0.0.0/8) nor a host name"
                )
            hosts.add(name)
        return cls(tuple(networks), frozenset(hosts))

    def allows_host(self, host: str) -> bool:
        return host.strip("[]").rstrip(".").lower() in self.hosts

    def allows(self, address: IPAddress) -> bool:
        """Whether ``address`` (or the IPv4 address it wraps) lies in a named network."""
        candidates = [address, *embedded_ipv4(address)]
        return any(
            candidate.version == network.version and candidate in network
            for candidate in candidates
            for network in self.networks
        )

    def refused(self, host: str, addresses: Iterable[IPAddress]) -> IPAddress | str | None:
        """What makes a connection to ``host`` (at ``addresses``) off limits: the first
        forbidden address outside the named networks, ``host`` itself for a local name, or
        None when the connection may go ahead."""
        if self.allows_host(host):
            return None
        addresses = list(addresses)
        for address in addresses:
            if is_forbidden_address(address) and not self.allows(address):
                return address
        if is_local_name(host) and not (addresses and all(map(self.allows, addresses))):
            return host  # "localhost" is this machine whatever a resolver answers for it
        return None
