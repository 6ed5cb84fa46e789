"""Images named by a local path: read only from inside --allowed-media-dir.

The path is resolved (symlinks and '..' included) and must lie inside the allowed dir before
a single byte is read; the file is then opened without following a last-moment symlink and
checked again by what was actually opened.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from loragate.gateway.errors import OpenAIError
from loragate.gateway.requests.images.limits import image_error, image_too_large


class LocalImages:
    """Reads image files for one media policy; ``allowed_dir`` is already resolved (or None:
    local paths are refused)."""

    def __init__(self, allowed_dir: Path | None, max_bytes: int) -> None:
        self.allowed_dir = allowed_dir
        self.max_bytes = max_bytes

    def read(self, raw_path: str, param: str) -> bytes:
        """The file's bytes, at most ``max_bytes`` of them; a 4xx naming ``param`` if refused."""
        if self.allowed_dir is None:
            raise OpenAIError(
                400,
                "Local image paths are disabled on this gateway. Send the image as a data URI or "
                "http(s) URL, or start the gateway with --allowed-media-dir DIR to allow files in DIR.",
                param=param,
                code="local_media_disabled",
            )
        if "\x00" in raw_path:
            raise image_error(param, "the image path contains a NUL character")
        try:
            candidate = Path(raw_path).expanduser()
        except RuntimeError:  # ~user for a user that does not exist
            raise image_error(
                param, f"the image path {raw_path} names an unknown home directory"
            ) from None
        if not candidate.is_absolute():
            candidate = self.allowed_dir / candidate
        try:
            # Not strict: whether a file outside the allowed dir exists is none of the client's business.
            resolved = candidate.resolve()
        except (OSError, RuntimeError):
            raise image_error(
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
            raise image_error(
                param, f"image file not found: {raw_path}", "image_not_found"
            ) from None
        except OSError as exc:
            raise image_error(
                param, f"the image file {raw_path} cannot be opened ({exc.strerror})"
            ) from None
        try:
            opened = _opened_path(fd)
            if opened is not None and not self._inside(opened):
                raise self._outside(raw_path, param)
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise image_error(param, f"the image path {raw_path} is not a regular file")
            if info.st_size > self.max_bytes:
                raise image_too_large(param, self.max_bytes)
            with os.fdopen(fd, "rb", closefd=False) as handle:
                data = handle.read(self.max_bytes + 1)
        finally:
            os.close(fd)
        if len(data) > self.max_bytes:
            raise image_too_large(param, self.max_bytes)
        return data


def _opened_path(fd: int) -> Path | None:
    """The path the kernel says ``fd`` has (Linux); None where that cannot be asked."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None
