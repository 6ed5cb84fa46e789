"""Images in requests: local paths (only inside --allowed-media-dir), data URIs, http(s) URLs,
raw base64 (a data URI without its ``data:`` prefix, as Vi's ``source`` takes it).

Every image reaches the engine as a data URI, checked here first (format, size, pixel count);
the engine never fetches a URL from a request (it is started with an allowed-media domain that
cannot exist: ``loragate.supervisor.command.NO_MEDIA_DOMAIN``). Local files are read by
``media_files``, URLs fetched by ``image_fetch`` (private addresses refused, see
``loragate.http.addresses``). Decoding runs in a small thread pool of its own
(``media_pools``), never on the event loop.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import re
from pathlib import Path
from urllib.parse import unquote

import httpx

from loragate.gateway.errors import OpenAIError
from loragate.gateway.requests.images.fetch import FETCH_TIMEOUT, ImageFetcher, Resolver
from loragate.gateway.requests.images.files import LocalImages
from loragate.gateway.requests.images.limits import ImageBudget, image_error, image_too_large
from loragate.gateway.requests.images.pools import in_pool
from loragate.gateway.requests.images.video import sniff_video
from loragate.settings import Settings

_SIGNATURES = {
    b"\x89PNG\r\n\x1a\n": "png",
    b"\xff\xd8\xff": "jpeg",
    b"GIF87a": "gif",
    b"GIF89a": "gif",
    b"BM": "bmp",
}
_WHITESPACE = b" \t\r\n"


class MediaPolicy:
    """Where a request's images may come from and how large they may be; one per settings."""

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
        self._files = LocalImages(self.allowed_dir, max_bytes)
        self._fetcher = ImageFetcher(
            max_bytes,
            private_urls,
            resolver=resolver,
            transport=transport,
            fetch_timeout=fetch_timeout,
        )

    async def image(self, url: object, param: str, budget: ImageBudget | None = None) -> str:
        """The checked image as a data URI for the engine, or a 4xx naming the problem."""
        uri = await self._image(url, param, budget)
        return budget.take(uri, param) if budget is not None else uri

    async def _image(self, url: object, param: str, budget: ImageBudget | None) -> str:
        if not isinstance(url, str) or not url.strip():
            raise image_error(
                param, "the image must be a non-empty string: a data URI, http(s) URL or local path"
            )
        lowered = url[:16].lower()
        if lowered.startswith(("http://", "https://")):
            data = await self._fetcher.fetch(url, param, budget)
            return data_uri(data, await in_pool("media", self._check_image, data, param))
        if lowered.startswith("data:"):
            return await in_pool("media", self._data_uri, url, param)
        if "://" in url[:16] and not lowered.startswith("file://"):
            raise image_error(
                param,
                f"unsupported image URL scheme in {url[:16]!r}: use data:, http(s):// or a local path",
            )
        raw = raw_base64_uri(url)
        if raw is not None:
            return await in_pool("media", self._data_uri, raw, param)
        path = unquote(url[7:]) if lowered.startswith("file://") else url
        return await in_pool("media", self._local_file, path, param)

    async def video(self, url: str, param: str, budget: ImageBudget | None = None) -> str:
        """The checked video (``video.names_a_video``) as a data URI for the engine: read from
        where an image would be, under the same caps; a 400 when its bytes are no video."""
        lowered = url[:16].lower()
        if lowered.startswith(("http://", "https://")):
            data = await self._fetcher.fetch(url, param, budget)
        elif lowered.startswith("data:"):
            data = await in_pool("media", self._decode_data_uri, url, param)
        else:
            path = unquote(url[7:]) if lowered.startswith("file://") else url
            data = await in_pool("media", self._files.read, path, param)
        mime = sniff_video(data)
        if mime is None:
            raise image_error(
                param, "the video is not an MP4, MOV, WebM, Matroska or AVI file", "invalid_video"
            )
        uri = f"data:{mime};base64,{base64.b64encode(data).decode()}"
        return budget.take(uri, param) if budget is not None else uri

    def _data_uri(self, url: str, param: str) -> str:
        data = self._decode_data_uri(url, param)
        return data_uri(data, self._check_image(data, param))

    def _local_file(self, path: str, param: str) -> str:
        data = self._files.read(path, param)
        return data_uri(data, self._check_image(data, param))

    def _decode_data_uri(self, url: str, param: str) -> bytes:
        header, sep, encoded = url.partition(",")
        if not sep or ";base64" not in header.lower():
            raise image_error(param, "a data URI must look like data:image/png;base64,<data>")
        if len(encoded) * 3 // 4 > self.max_bytes + 3:
            raise image_too_large(param, self.max_bytes)
        raw = encoded.encode("ascii", errors="replace").translate(None, _WHITESPACE)
        try:
            data = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            raise image_error(param, "the data URI is not valid base64") from None
        if len(data) > self.max_bytes:
            raise image_too_large(param, self.max_bytes)
        return data

    def _check_image(self, data: bytes, param: str) -> str:
        fmt = sniff_format(data)
        if fmt is None:
            raise image_error(param, "the image is not a PNG, JPEG, GIF, BMP or WebP file")
        from PIL import Image

        try:
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                if width <= 0 or height <= 0 or width * height > self.max_pixels:
                    raise image_error(
                        param,
                        f"the image is {width}x{height} pixels; the limit is {self.max_pixels} "
                        "(--max-image-pixels)",
                        "image_too_large",
                    )
                image.load()  # decodes every byte: a truncated or corrupt file fails here
        except OpenAIError:
            raise
        except Exception:
            raise image_error(param, f"the {fmt.upper()} image is truncated or corrupt") from None
        return fmt


def media_policy_of(settings: Settings) -> MediaPolicy:
    """The image policy ``settings`` set (--allowed-media-dir, sizes, private URLs)."""
    return _media_policy(
        settings.allowed_media_dir,
        settings.max_image_bytes,
        settings.max_image_pixels,
        settings.private_image_urls,
    )


@functools.lru_cache(maxsize=8)
def _media_policy(
    allowed_dir: Path | None, max_bytes: int, max_pixels: int, private_urls: bool
) -> MediaPolicy:
    return MediaPolicy(allowed_dir, max_bytes, max_pixels, private_urls)


def data_uri(data: bytes, fmt: str) -> str:
    return f"data:image/{fmt};base64,{base64.b64encode(data).decode()}"


_RAW_BASE64 = re.compile(r"[A-Za-z0-9+/\s]+={0,2}\s*")


def raw_base64_uri(text: str) -> str | None:
    """``text`` as a data URI when it is a raw base64 image or video (no ``data:`` prefix),
    which the Vi server's schema accepts as a ``source`` (``vi/deployment/local/schemas.py``:
    "a file path, URL, or base64-encoded image string") and its backends as an ``image_url``;
    None for anything else (a path, a URL, a data URI). Only the first bytes are decoded here,
    to recognise the format; the image check reads the rest."""
    if len(text) < 16 or not _RAW_BASE64.fullmatch(text):
        return None
    compact = "".join(text.split())
    try:
        head = base64.b64decode(compact[:64], validate=True)
    except (binascii.Error, ValueError):
        return None
    fmt = sniff_format(head)
    if fmt:
        return f"data:image/{fmt};base64,{compact}"
    mime = sniff_video(head)
    return f"data:{mime};base64,{compact}" if mime else None


def sniff_format(data: bytes) -> str | None:
    for signature, fmt in _SIGNATURES.items():
        if data.startswith(signature):
            return fmt
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None
