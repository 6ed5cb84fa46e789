"""Fetch an adapter from where the user keeps it into a local directory.

Source forms, one module each:

- ``local``: a local directory (used in place) or a local ``.tar`` / ``.tar.gz`` / ``.tgz`` /
  ``.zip``;
- ``hub``: ``hf://ORG/REPO[@REV][/SUBDIR]``, a Hugging Face repo, pinned to the commit it
  resolved to;
- ``url``: ``https://...`` / ``http://...``, an archive, streamed with a size cap and resumed
  on retry;
- ``tinker``: ``tinker://RUN/sampler_weights/NAME`` (or ``weights``, ``external_weights``;
  NAME may be ``latest``), a Tinker checkpoint, through the ``tinker`` SDK.

Every http(s) connection (archives, Tinker's signed URLs, a hub endpoint set in the
environment) is checked by ``source_networks``: no loopback, private or link-local address
unless ``allowed_source_networks`` names it.

``source_fingerprint`` gives a cheap marker that changes when the source does, for
follow mode: it never downloads the adapter itself.
"""

from __future__ import annotations

from pathlib import Path

from loragate.adapters.archives import DEFAULT_MAX_BYTES, DEFAULT_MAX_MEMBERS, UnsafeArchiveError
from loragate.adapters.downloads import DEFAULT_DEADLINE, DEFAULT_TIMEOUT, DownloadError
from loragate.adapters.source_networks import SourceAddressRefused
from loragate.adapters.sources.fetched import FetchedSource, FetchLimits, SourceError
from loragate.adapters.sources.hub import fetch_hf, hf_fingerprint
from loragate.adapters.sources.local import fetch_local, local_fingerprint
from loragate.adapters.sources.tinker import fetch_tinker, tinker_fingerprint
from loragate.adapters.sources.url import fetch_url, url_fingerprint

__all__ = ["FetchedSource", "SourceError", "fetch_source", "source_fingerprint"]


def fetch_source(
    source: str,
    dest: Path,
    revision: str | None = None,
    progress: bool = True,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_members: int = DEFAULT_MAX_MEMBERS,
    timeout: float = DEFAULT_TIMEOUT,
    deadline: float = DEFAULT_DEADLINE,
    download_dir: Path | None = None,
    hf_cache_dir: Path | None = None,
) -> FetchedSource:
    """Bring ``source`` onto local disk and return where its adapter lies.

    Archives and downloads are unpacked into ``dest`` (absent or empty); a local directory
    is used in place. ``download_dir`` keeps partial downloads between attempts so they
    resume (default: ``dest``'s parent). Archives are capped at ``max_bytes`` (downloaded
    and unpacked) and ``max_members``, ``hf://`` repos at ``max_bytes`` too; each http(s)
    download must finish within ``deadline`` seconds. ``hf://`` repos come from the user's
    Hugging Face hub cache (downloaded there when missing), or from ``hf_cache_dir`` when an
    earlier loragate downloaded them there.
    """
    limits = FetchLimits(max_bytes, max_members, timeout, download_dir or dest.parent, deadline)
    try:
        if source.startswith("hf://"):
            return fetch_hf(source, dest, revision, progress, hf_cache_dir, limits.max_bytes)
        if source.startswith(("https://", "http://")):
            return fetch_url(source, dest, progress, limits)
        if source.startswith("tinker://"):
            return fetch_tinker(source, dest, progress, limits)
        return fetch_local(source, dest, limits)
    except (UnsafeArchiveError, DownloadError, SourceAddressRefused) as exc:
        raise SourceError(str(exc)) from exc


def source_fingerprint(
    source: str, revision: str | None = None, *, timeout: float = DEFAULT_TIMEOUT
) -> str | None:
    """A cheap marker that changes when ``source`` does; None when it cannot be told.

    HF: the commit sha the revision points at; URL: its ETag or Last-Modified (HEAD);
    local directory: a hash of (path, size, mtime) of its files; Tinker: the newest
    checkpoint of the path's kind (for ``NAME`` = ``latest``) or the named one's time.
    """
    try:
        if source.startswith("hf://"):
            return hf_fingerprint(source, revision)
        if source.startswith(("https://", "http://")):
            return url_fingerprint(source, timeout)
        if source.startswith("tinker://"):
            return tinker_fingerprint(source)
    except (DownloadError, SourceAddressRefused) as exc:
        raise SourceError(str(exc)) from exc
    return local_fingerprint(source)
