"""Video files in a Vi ``source``: told apart from images, recognised by their first bytes.

A Vi ``video-freeform`` request names a video where an image would go (the Vi SDK's
``VIDEO_SUPPORTED_MODELS``: Cosmos Reason2). The gateway reads it as it reads an image (a
file inside --allowed-media-dir, a data URI, an http(s) URL through the same fetcher, with
the same size caps), checks that its bytes are a video container, and hands the engine a
``video_url`` part with a data URI: vLLM's video models decode it themselves.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

# What a ``source`` naming a video file ends with (its path; a URL's query aside).
VIDEO_EXTENSIONS = frozenset({".mp4", ".m4v", ".mov", ".webm", ".mkv", ".avi"})
_EXTENSION = re.compile(r"\.[A-Za-z0-9]{2,4}$")


def names_a_video(source: str) -> bool:
    """Whether ``source`` is a video: a ``data:video/`` URI, or a path or URL whose file name
    ends with a video extension."""
    if source[:11].lower() == "data:video/":
        return True
    if source[:5].lower() == "data:":
        return False
    try:
        path = urlsplit(source).path if "://" in source[:16] else source
    except ValueError:  # a malformed URL (a bad IPv6 host): the image checks say what is wrong
        return False
    found = _EXTENSION.search(path)
    return found is not None and found.group().lower() in VIDEO_EXTENSIONS


def sniff_video(data: bytes) -> str | None:
    """The video's MIME type by its container's signature (None: not a video engines read).

    ISO base media (MP4, MOV): an ``ftyp`` box first, its brand telling QuickTime apart;
    Matroska and WebM: the EBML magic, WebM naming its DocType; AVI: a RIFF ``AVI `` form.
    """
    if data[4:8] == b"ftyp":
        return "video/quicktime" if data[8:12] == b"qt  " else "video/mp4"
    if data.startswith(b"\x1a\x45\xdf\xa3"):
        return "video/webm" if b"webm" in data[:64] else "video/x-matroska"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "video/x-msvideo"
    return None
