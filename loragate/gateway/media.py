"""Images in requests: local paths (only inside --allowed-media-dir), data URIs, http(s) URLs.

Every image reaches the engine as a data URI, checked here first (format, size, pixel count);
the engine never fetches a URL from a request (it is started with an allowed-media domain that
cannot exist, see ``ENGINE_MEDIA_ARGS``).

A local path is resolved (symlinks and '..' included) and must lie inside the allowed dir
before a single byte is read; the file is then opened without following a last-moment
symlink and checked again by what was actually opened.

An http(s) URL is fetched by the gateway itself. Its host is resolved once, the way the
operating system resolves it for any client (so ``0x7f000001``, ``2130706433``, ``127.1``
and ``0`` are the numeric addresses they stand for), every answer is checked, and the
connection goes to the checked address, with the name kept for the ``Host`` header, TLS SNI
and certificate checks. An answer that changes between the check and the fetch (DNS
rebinding) therefore changes nothing. Redirects are followed by hand, each hop checked the
same way. Decoding and DNS run in small thread pools of their own, never on the event loop
and never in the default pool the supervisor needs for its own work.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import io
import ipaddress
import os
import socket
import ssl
import stat
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote

import httpx

from loragate.gateway.errors import OpenAIError

_SIGNATURES = {
    b"\x89PNG\r\n\x1a\n": "png",
    b"\xff\xd8\xff": "jpeg",
    b"GIF87a": "gif",
    b"GIF89a": "gif",
    b"BM": "bmp",
}
_WHITESPACE = b" \t\r\n"

FETCH_TIMEOUT = 30.0  # seconds for one image URL, redirects included, from DNS to last byte
MAX_REDIRECTS = 3
# The engine may fetch only from this domain, which cannot exist (RFC 2606 reserves .invalid):
# every image it gets from the gateway is a data URI, and no URL can slip past the gateway.
ENGINE_MEDIA_ARGS = ["--allowed-media-domains", "loragate.invalid"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# host, port -> the addresses a connection to the host would use (strings, as getaddrinfo gives)
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
_T = TypeVar("_T")

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
    infos = await _in_pool(
        "dns", functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    )
    return [str(info[4][0]) for info in infos]


def engine_media_env(max_image_bytes: int) -> dict[str, str]:
    """The engine's own limits, should a URL ever reach it despite ``ENGINE_MEDIA_ARGS``: the
    gateway's size cap, and no redirects."""
    return {
        "VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB": str(max(1, -(-max_image_bytes // (1 << 20)))),
        "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0",
    }


class ImageBudget:
    """What the images of one request may add to the body the engine gets: its body cap, as if
    every image had come inline. A short request naming 16 URLs (or local files) must not make
    the gateway hold and send 16 times --max-image-bytes."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.left = total

    def take(self, uri: str, param: str) -> str:
        self.left -= len(uri)
        if self.left < 0:
            raise self.exceeded(param)
        return uri

    def exceeded(self, param: str) -> OpenAIError:
        return _bad(
            param,
            f"the images of this request add up to more than {self.total} bytes as data URIs "
            "(--max-body-bytes)",
            "images_too_large",
        )


class MediaPolicy:
    def __init__(
        self,
        allowed_dir: Path | None,
        max_bytes: int,
        max_pixels: int,
        private_urls: bool = False,
        *,
        resolver: Resolver | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        fetch_timeout: float = FETCH_TIMEOUT,
    ) -> None:
        self.allowed_dir = allowed_dir.expanduser().resolve() if allowed_dir else None
        self.max_bytes = max_bytes
        self.max_pixels = max_pixels
        self.private_urls = private_urls
        self.fetch_timeout = fetch_timeout
        self._resolver = resolver
        self._transport = transport

    async def image(self, url: object, param: str, budget: ImageBudget | None = None) -> str:
        """The checked image as a data URI for the engine, or a 4xx naming the problem."""
        uri = await self._image(url, param, budget)
        return budget.take(uri, param) if budget is not None else uri

    async def _image(self, url: object, param: str, budget: ImageBudget | None) -> str:
        if not isinstance(url, str) or not url.strip():
            raise _bad(
                param, "the image must be a non-empty string: a data URI, http(s) URL or local path"
            )
        lowered = url[:16].lower()
        if lowered.startswith(("http://", "https://")):
            data = await self._fetch(url, param, budget)
            return data_uri(data, await _in_pool("media", self._check_image, data, param))
        if lowered.startswith("data:"):
            return await _in_pool("media", self._data_uri, url, param)
        if "://" in url[:16] and not lowered.startswith("file://"):
            raise _bad(
                param,
                f"unsupported image URL scheme in {url[:16]!r}: use data:, http(s):// or a local path",
            )
        path = unquote(url[7:]) if lowered.startswith("file://") else url
        return await _in_pool("media", self._local_file, path, param)

    def _data_uri(self, url: str, param: str) -> str:
        data = self._decode_data_uri(url, param)
        return data_uri(data, self._check_image(data, param))

    def _local_file(self, path: str, param: str) -> str:
        data = self._read_local(path, param)
        return data_uri(data, self._check_image(data, param))

    # ----- http(s) URLs --------------------------------------------------------------------

    async def _fetch(self, url: str, param: str, budget: ImageBudget | None) -> bytes:
        shown = repr(url[:80])
        try:
            async with asyncio.timeout(self.fetch_timeout):
                return await self._fetch_following(url, param, budget)
        except TimeoutError:
            raise _bad(
                param,
                f"the image URL {shown} did not deliver the image within {self.fetch_timeout:g} s",
                "image_fetch_failed",
            ) from None
        except httpx.HTTPError as exc:
            raise _bad(
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
                        raise _bad(
                            param,
                            f"the image URL {url[:80]!r} answered HTTP {response.status_code}",
                            "image_fetch_failed",
                        )
                    return await self._read_capped(response, param, budget)
                finally:
                    await response.aclose()
        raise _bad(
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
                raise _bad(
                    param,
                    f"the host of the image URL {url[:80]!r} cannot be resolved ({exc})",
                    "image_fetch_failed",
                ) from None
            if not addresses:
                raise _bad(
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
            raise _too_large(param, self.max_bytes)
        raise budget.exceeded(param)

    # ----- local files ---------------------------------------------------------------------

    def _read_local(self, raw_path: str, param: str) -> bytes:
        if self.allowed_dir is None:
            raise OpenAIError(
                400,
                "Local image paths are disabled on this gateway. Send the image as a data URI or "
                "http(s) URL, or start the gateway with --allowed-media-dir DIR to allow files in DIR.",
                param=param,
                code="local_media_disabled",
            )
        if "\x00" in raw_path:
            raise _bad(param, "the image path contains a NUL character")
        try:
            candidate = Path(raw_path).expanduser()
        except RuntimeError:  # ~user for a user that does not exist
            raise _bad(
                param, f"the image path {raw_path} names an unknown home directory"
            ) from None
        if not candidate.is_absolute():
            candidate = self.allowed_dir / candidate
        try:
            # Not strict: whether a file outside the allowed dir exists is none of the client's business.
            resolved = candidate.resolve()
        except (OSError, RuntimeError):
            raise _bad(
                param, f"the image path {raw_path} cannot be resolved (a symlink loop?)"
            ) from None
        if not self._inside(resolved):
            raise self._outside(raw_path, param)
        return self._read_inside(resolved, raw_path, param)

    def _inside(self, path: Path) -> bool:
        assert self.allowed_dir is not None
        return path == self.allowed_dir or path.is_relative_to(self.allowed_dir)

    def _outside(self, raw_path: str, param: str) -> OpenAIError:
        return OpenAIError(
            403,
            f"The image path {raw_path} is outside the allowed media directory "
            f"({self.allowed_dir}); it was not read.",
            param=param,
            code="media_path_forbidden",
        )

    def _read_inside(self, resolved: Path, raw_path: str, param: str) -> bytes:
        try:
            # O_NOFOLLOW: a symlink swapped in after resolve() is refused, not followed.
            fd = os.open(
                resolved, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
            )
        except FileNotFoundError:
            raise _bad(param, f"image file not found: {raw_path}", "image_not_found") from None
        except OSError as exc:
            raise _bad(
                param, f"the image file {raw_path} cannot be opened ({exc.strerror})"
            ) from None
        try:
            opened = _opened_path(fd)
            if opened is not None and not self._inside(opened):
                raise self._outside(raw_path, param)
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise _bad(param, f"the image path {raw_path} is not a regular file")
            if info.st_size > self.max_bytes:
                raise _too_large(param, self.max_bytes)
            with os.fdopen(fd, "rb", closefd=False) as handle:
                data = handle.read(self.max_bytes + 1)
        finally:
            os.close(fd)
        if len(data) > self.max_bytes:
            raise _too_large(param, self.max_bytes)
        return data

    # ----- data URIs and image checks ------------------------------------------------------

    def _decode_data_uri(self, url: str, param: str) -> bytes:
        header, sep, encoded = url.partition(",")
        if not sep or ";base64" not in header.lower():
            raise _bad(param, "a data URI must look like data:image/png;base64,<data>")
        if len(encoded) * 3 // 4 > self.max_bytes + 3:
            raise _too_large(param, self.max_bytes)
        raw = encoded.encode("ascii", errors="replace").translate(None, _WHITESPACE)
        try:
            data = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            raise _bad(param, "the data URI is not valid base64") from None
        if len(data) > self.max_bytes:
            raise _too_large(param, self.max_bytes)
        return data

    def _check_image(self, data: bytes, param: str) -> str:
        fmt = sniff_format(data)
        if fmt is None:
            raise _bad(param, "the image is not a PNG, JPEG, GIF, BMP or WebP file")
        from PIL import Image

        try:
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                if width <= 0 or height <= 0 or width * height > self.max_pixels:
                    raise _bad(
                        param,
                        f"the image is {width}x{height} pixels; the limit is {self.max_pixels} "
                        "(--max-image-pixels)",
                        "image_too_large",
                    )
                image.load()  # decodes every byte: a truncated or corrupt file fails here
        except OpenAIError:
            raise
        except Exception:
            raise _bad(param, f"the {fmt.upper()} image is truncated or corrupt") from None
        return fmt


def data_uri(data: bytes, fmt: str) -> str:
    return f"data:image/{fmt};base64,{base64.b64encode(data).decode()}"


def sniff_format(data: bytes) -> str | None:
    for signature, fmt in _SIGNATURES.items():
        if data.startswith(signature):
            return fmt
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def _opened_path(fd: int) -> Path | None:
    """The path the kernel says ``fd`` has (Linux); None where that cannot be asked."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None


def _too_large(param: str, max_bytes: int) -> OpenAIError:
    return _bad(
        param, f"the image is larger than {max_bytes} bytes (--max-image-bytes)", "image_too_large"
    )


def _bad(param: str, message: str, code: str = "invalid_image") -> OpenAIError:
    return OpenAIError(400, message[0].upper() + message[1:] + ".", param=param, code=code)


def _parse_url(url: str, param: str) -> httpx.URL:
    try:
        target = httpx.URL(url)
    except (httpx.InvalidURL, ValueError):
        raise _bad(param, f"the image URL {url[:80]!r} is malformed or has no valid host") from None
    if target.scheme not in ("http", "https") or not target.raw_host:
        raise _bad(param, f"the image URL {url[:80]!r} has no valid host")
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


_POOL_SIZES = {"media": min(4, os.cpu_count() or 1), "dns": 4}
_pools: dict[str, ThreadPoolExecutor] = {}


def _pool(kind: str) -> ThreadPoolExecutor:
    pool = _pools.get(kind)
    if pool is None:
        pool = _pools[kind] = ThreadPoolExecutor(
            max_workers=_POOL_SIZES[kind], thread_name_prefix=f"loragate-{kind}"
        )
    return pool


async def _in_pool(kind: str, fn: Callable[..., _T], *args: Any) -> _T:
    """Run ``fn`` in the bounded pool for ``kind``: image work never fills the default pool."""
    return await asyncio.get_running_loop().run_in_executor(_pool(kind), fn, *args)
