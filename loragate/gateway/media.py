"""Images in requests: local paths (only inside --allowed-media-dir), data URIs, http(s) URLs.

A local path is resolved (symlinks and '..' included) and must lie inside the allowed dir
before a single byte is read; the file is then opened without following a last-moment
symlink and checked again by what was actually opened. Local files and data URIs are
sniffed and checked (format, size, pixel count) and reach the engine as data URIs; http(s)
URLs pass through unchanged (the engine fetches them).
"""

from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import os
import stat
from pathlib import Path
from urllib.parse import unquote, urlsplit

from loragate.gateway.errors import OpenAIError

_SIGNATURES = {
    b"\x89PNG\r\n\x1a\n": "png",
    b"\xff\xd8\xff": "jpeg",
    b"GIF87a": "gif",
    b"GIF89a": "gif",
    b"BM": "bmp",
}
_WHITESPACE = b" \t\r\n"


def is_private_host(host: str) -> bool:
    """Whether ``host`` names this machine or a non-public network by itself (a literal
    address, or localhost). Names that merely resolve to one are the engine's to fetch, with
    redirects off (see ``engine_media_env``)."""
    host = host.strip("[]").rstrip(".").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return not address.is_global


def engine_media_env(max_image_bytes: int, private_urls: bool) -> dict[str, str]:
    """The engine's own limits for the image URLs it fetches: the gateway's size cap, and no
    redirects unless private addresses are allowed (a public URL could redirect to one)."""
    env = {"VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB": str(max(1, -(-max_image_bytes // (1 << 20))))}
    if not private_urls:
        env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] = "0"
    return env


class MediaPolicy:
    def __init__(
        self,
        allowed_dir: Path | None,
        max_bytes: int,
        max_pixels: int,
        private_urls: bool = False,
    ) -> None:
        self.allowed_dir = allowed_dir.expanduser().resolve() if allowed_dir else None
        self.max_bytes = max_bytes
        self.max_pixels = max_pixels
        self.private_urls = private_urls

    def image_url(self, url: object, param: str) -> str:
        """The URL to send to the engine for ``url``, or a 400 naming the problem."""
        if not isinstance(url, str) or not url.strip():
            raise _bad(
                param, "the image must be a non-empty string: a data URI, http(s) URL or local path"
            )
        lowered = url[:16].lower()
        if lowered.startswith(("http://", "https://")):
            try:
                host = urlsplit(url).hostname
            except ValueError:  # e.g. an unclosed IPv6 bracket
                host = None
            if not host:
                raise _bad(param, f"the image URL {url[:80]!r} has no valid host")
            if not self.private_urls and is_private_host(host):
                raise OpenAIError(
                    403,
                    f"the image URL {url[:80]!r} points at a loopback, private or link-local "
                    "address, which the engine will not fetch on this gateway (start it with "
                    "--private-image-urls to allow that), or send the image as a data URI",
                    param=param,
                    code="image_url_forbidden",
                )
            return url
        if lowered.startswith("data:"):
            data = self._decode_data_uri(url, param)
            return data_uri(data, self._check_image(data, param))
        if "://" in url[:16] and not lowered.startswith("file://"):
            raise _bad(
                param,
                f"unsupported image URL scheme in {url[:16]!r}: use data:, http(s):// or a local path",
            )
        path = unquote(url[7:]) if lowered.startswith("file://") else url
        data = self._read_local(path, param)
        return data_uri(data, self._check_image(data, param))

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
