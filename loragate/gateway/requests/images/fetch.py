"""Fetching an image URL for a request, without letting the URL reach what it must not.

The host is resolved once, the way the operating system resolves it for any client, every
answer is checked (``loragate.http.addresses``), and the connection goes to the checked
address, with the name kept for the ``Host`` header, TLS SNI and certificate checks. An
answer that changes between the check and the fetch (DNS rebinding) therefore changes
nothing. Redirects are followed by hand, each hop checked the same way, and reading stops as
soon as the body passes the image's or the request's limit.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence

import httpx

from loragate.gateway.errors import OpenAIError
from loragate.gateway.requests.images.limits import ImageBudget, image_error, image_too_large
from loragate.gateway.requests.images.pools import in_pool
from loragate.http.addresses import is_forbidden_address, is_local_name, literal_address

FETCH_TIMEOUT = 30.0  # seconds for one image URL, redirects included, from DNS to last byte
MAX_REDIRECTS = 3

# host, port -> the addresses a connection to the host would use (strings, as getaddrinfo gives)
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses the OS resolver gives for ``host`` (getaddrinfo, in the DNS pool)."""
    infos = await in_pool(
        "dns", functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    )
    return [str(info[4][0]) for info in infos]


class ImageFetcher:
    """Fetches image URLs for one media policy (its size cap and its private-address rule)."""

    def __init__(
        self,
        max_bytes: int,
        private_urls: bool = False,
        *,
        resolver: Resolver | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        fetch_timeout: float = FETCH_TIMEOUT,
    ) -> None:
        self.max_bytes = max_bytes
        self.private_urls = private_urls
        self.fetch_timeout = fetch_timeout
        self._resolver = resolver
        self._transport = transport

    async def fetch(self, url: str, param: str, budget: ImageBudget | None) -> bytes:
        """The image's bytes, unchecked as an image; a 4xx naming ``param`` when refused."""
        shown = repr(url[:80])
        try:
            async with asyncio.timeout(self.fetch_timeout):
                return await self._fetch_following(url, param, budget)
        except TimeoutError:
            raise image_error(
                param,
                f"the image URL {shown} did not deliver the image within {self.fetch_timeout:g} s",
                "image_fetch_failed",
            ) from None
        except httpx.HTTPError as exc:
            raise image_error(
                param,
                f"the image URL {shown} could not be fetched ({exc.__class__.__name__}: {exc})",
                "image_fetch_failed",
            ) from None

    async def _fetch_following(self, url: str, param: str, budget: ImageBudget | None) -> bytes:
        async with httpx.AsyncClient(
            transport=self._transport,
            verify=_tls_context(),
            trust_env=False,  # a proxy would resolve the name again, unchecked
            follow_redirects=False,  # each hop is checked below
            timeout=httpx.Timeout(self.fetch_timeout),
        ) as client:
            for _ in range(MAX_REDIRECTS + 1):
                target = _parse_url(url, param)
                request = client.build_request(
                    "GET",
                    target.copy_with(host=await self._checked_address(target, url, param)),
                    headers={
                        "Host": target.netloc.decode("ascii"),
                        "Accept": "image/*",
                        "Accept-Encoding": "identity",
                    },
                    # The name, not the address, for TLS: SNI and the certificate check.
                    extensions={"sni_hostname": target.raw_host.decode("ascii")},
                )
                response = await client.send(request, stream=True)
                try:
                    location = response.headers.get("Location")
                    if response.is_redirect and location:
                        url = str(target.join(location))
                        continue
                    if response.status_code != 200:
                        raise image_error(
                            param,
                            f"the image URL {url[:80]!r} answered HTTP {response.status_code}",
                            "image_fetch_failed",
                        )
                    return await self._read_capped(response, param, budget)
                finally:
                    await response.aclose()
        raise image_error(
            param,
            f"the image URL redirects more than {MAX_REDIRECTS} times",
            "image_fetch_failed",
        )

    async def _checked_address(self, target: httpx.URL, url: str, param: str) -> str:
        """The one address the fetch connects to: resolved once, every answer checked."""
        host = target.raw_host.decode("ascii")
        literal = literal_address(host)
        if literal is not None:
            addresses = [literal]
        else:
            if not self.private_urls and is_local_name(host):
                raise _forbidden(param, url, host)
            resolver = self._resolver or system_resolver
            port = target.port or (443 if target.scheme == "https" else 80)
            try:
                answers = await resolver(host, port)
                addresses = [ipaddress.ip_address(answer) for answer in answers]
            except (OSError, ValueError) as exc:
                raise image_error(
                    param,
                    f"the host of the image URL {url[:80]!r} cannot be resolved ({exc})",
                    "image_fetch_failed",
                ) from None
            if not addresses:
                raise image_error(
                    param,
                    f"the host of the image URL {url[:80]!r} has no address",
                    "image_fetch_failed",
                )
        if not self.private_urls:
            for address in addresses:
                if is_forbidden_address(address):
                    raise _forbidden(param, url, str(address))
        return str(addresses[0])

    async def _read_capped(
        self, response: httpx.Response, param: str, budget: ImageBudget | None
    ) -> bytes:
        """The body; reading stops as soon as it passes the image's or the request's limit."""
        # As a data URI (base64) the image must still fit what the request has left.
        cap = self.max_bytes if budget is None else min(self.max_bytes, budget.left * 3 // 4)
        length = response.headers.get("Content-Length")
        size = int(length) if length is not None and length.isdigit() else 0
        data = bytearray()
        if size <= cap:
            async for block in response.aiter_raw():
                data += block
                size = max(size, len(data))
                if size > cap:
                    break
        if size <= cap:
            return bytes(data)
        if size > self.max_bytes or budget is None:
            raise image_too_large(param, self.max_bytes)
        raise budget.exceeded(param)


def _parse_url(url: str, param: str) -> httpx.URL:
    try:
        target = httpx.URL(url)
    except (httpx.InvalidURL, ValueError):
        raise image_error(
            param, f"the image URL {url[:80]!r} is malformed or has no valid host"
        ) from None
    if target.scheme not in ("http", "https") or not target.raw_host:
        raise image_error(param, f"the image URL {url[:80]!r} has no valid host")
    return target


def _forbidden(param: str, url: str, address: str) -> OpenAIError:
    return OpenAIError(
        403,
        f"The image URL {url[:80]!r} points at a loopback, private or link-local address "
        f"({address}), which this gateway will not fetch (start it with --private-image-urls "
        "to allow that); send the image as a data URI instead.",
        param=param,
        code="image_url_forbidden",
    )


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()
