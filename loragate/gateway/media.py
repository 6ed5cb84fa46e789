"""Images in requests: local paths (only inside --allowed-media-dir), data URIs, http(s) URLs.

A local path is resolved (symlinks and '..' included) and must stay inside the allowed dir
before a single byte is read. Local files and data URIs are sniffed and checked (format,
size, pixel count) and reach the engine as data URIs; http(s) URLs pass through unchanged.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

from loragate.gateway.errors import OpenAIError

_SIGNATURES = {
    b"\x89PNG\r\n\x1a\n": "png",
    b"\xff\xd8\xff": "jpeg",
    b"GIF87a": "gif",
    b"GIF89a": "gif",
    b"BM": "bmp",
}


class MediaPolicy:
    def __init__(self, allowed_dir: Path | None, max_bytes: int, max_pixels: int) -> None:
        self.allowed_dir = allowed_dir.expanduser().resolve() if allowed_dir else None
        self.max_bytes = max_bytes
        self.max_pixels = max_pixels

    def image_url(self, url: str, param: str) -> str:
        """The URL to send to the engine for ``url``, or a 400 naming the problem."""
        if not isinstance(url, str) or not url:
            raise _bad(param, "the image must be a non-empty string: a data URI, http(s) URL or local path")
        lowered = url[:16].lower()
        if lowered.startswith(("http://", "https://")):
            return url
        if lowered.startswith("data:"):
            data = self._decode_data_uri(url, param)
            self._check_image(data, param)
            return url
        if "://" in url[:16] and not lowered.startswith("file://"):
            raise _bad(param, f"unsupported image URL scheme in {url[:16]!r}: use data:, http(s):// or a local path")
        path = url[7:] if lowered.startswith("file://") else url
        data = self._read_local(path, param)
        fmt = self._check_image(data, param)
        return f"data:image/{fmt};base64,{base64.b64encode(data).decode()}"

    def _read_local(self, raw_path: str, param: str) -> bytes:
        if self.allowed_dir is None:
            raise OpenAIError(
                400,
                "Local image paths are disabled on this gateway. Send the image as a data URI or "
                "http(s) URL, or start the gateway with --allowed-media-dir DIR to allow files in DIR.",
                param=param,
                code="local_media_disabled",
            )
        candidate = Path(raw_path).expanduser()
        if not candidate.is_absolute():
            candidate = self.allowed_dir / candidate
        try:
            resolved = candidate.resolve(strict=True)
        except (OSError, RuntimeError):
            raise _bad(param, f"image file not found: {raw_path}", code="image_not_found") from None
        if not resolved.is_relative_to(self.allowed_dir):
            raise OpenAIError(
                403,
                f"The image path {raw_path} is outside the allowed media directory "
                f"({self.allowed_dir}); it was not read.",
                param=param,
                code="media_path_forbidden",
            )
        if not resolved.is_file():
            raise _bad(param, f"the image path {raw_path} is not a regular file")
        if resolved.stat().st_size > self.max_bytes:
            raise _bad(param, f"the image is larger than {self.max_bytes} bytes (--max-image-bytes)", "image_too_large")
        return resolved.read_bytes()

    def _decode_data_uri(self, url: str, param: str) -> bytes:
        header, sep, encoded = url.partition(",")
        if not sep or ";base64" not in header.lower():
            raise _bad(param, "a data URI must look like data:image/png;base64,<data>", "invalid_image")
        if len(encoded) * 3 // 4 > self.max_bytes:
            raise _bad(param, f"the image is larger than {self.max_bytes} bytes (--max-image-bytes)", "image_too_large")
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise _bad(param, "the data URI is not valid base64", "invalid_image") from None
        return data

    def _check_image(self, data: bytes, param: str) -> str:
        fmt = sniff_format(data)
        if fmt is None:
            raise _bad(param, "the image is not a PNG, JPEG, GIF, BMP or WebP file", "invalid_image")
        import io

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
            raise _bad(param, f"the {fmt.upper()} image is truncated or corrupt", "invalid_image") from None
        return fmt


def sniff_format(data: bytes) -> str | None:
    for signature, fmt in _SIGNATURES.items():
        if data.startswith(signature):
            return fmt
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def _bad(param: str, message: str, code: str = "invalid_image") -> OpenAIError:
    return OpenAIError(400, message[0].upper() + message[1:] + ".", param=param, code=code)
