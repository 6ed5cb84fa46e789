"""Fetch an adapter from where the user keeps it into a local directory.

Source forms, one module each:

- ``local``: a local directory (used in place) or a local ``.tar`` / ``.tar.gz`` / ``.tgz`` /
  ``.zip``;
- ``hub``: ``hf://ORG/REPO[@REV][/SUBDIR]``, a Hugging Face repo, pinned to the commit it
  resolved to; a bare ``ORG/REPO[@REV]`` that is no local path means the same (as vLLM's
  ``--lora-modules`` reads it): ``hub_source_of``;
- ``url``: ``https://...`` / ``http://...``, an archive, streamed with a size cap and resumed
  on retry;
- ``tinker``: ``tinker://RUN/sampler_weights/NAME`` (or ``weights``, ``external_weights``;
  NAME may be ``latest``), a Tinker checkpoint, through the ``tinker`` SDK.

Every http(s) connection (archives, Tinker's signed URLs, a hub endpoint set in the
environment) is checked by ``source_networks``: no loopback, private or link-local address
unless ``allowed_source_networks`` names it.

``source_fingerprint`` gives a cheap marker that changes when the source does, for
follow mode: it never downloads the adapter itself. ``admit_client_source`` is what an admin
client may name: local paths only under the adapter source roots.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from loragate.adapters.intake.archives import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_MEMBERS,
    UnsafeArchiveError,
)
from loragate.adapters.intake.downloads import DEFAULT_DEADLINE, DEFAULT_TIMEOUT, DownloadError
from loragate.adapters.intake.sources.fetched import FetchedSource, FetchLimits
from loragate.adapters.intake.sources.hub import fetch_hf, hf_fingerprint
from loragate.adapters.intake.sources.local import (
    SourceNotAllowed,
    admit_local_path,
    fetch_local,
    local_fingerprint,
    resolved_under,
)
from loragate.adapters.intake.sources.tinker import fetch_tinker, tinker_fingerprint
from loragate.adapters.intake.sources.url import fetch_url, url_fingerprint
from loragate.fetching import SourceError
from loragate.fetching.source_networks import SourceAddressRefused

__all__ = [
    "FetchedSource",
    "SourceError",
    "SourceNotAllowed",
    "admit_client_source",
    "fetch_source",
    "hub_source_of",
    "source_fingerprint",
]

# ORG/REPO[@REV] as the hub spells ids: one slash, no leading "/", "./" or "~", which say "a path".
_BARE_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(?:@[^/\s]+)?$")
_ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip")
_REMOTE_SCHEMES = ("hf://", "https://", "http://", "tinker://")
# ``ftp://...``, ``s3://...``, ``javascript:...``: an address of a kind no source module reads.
_OTHER_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def hub_source_of(source: str) -> str:
    """``hf://ORG/REPO[@REV]`` for a bare hub id that names no existing local path (vLLM's
    ``--lora-modules`` takes ``org/repo`` so); any other source as it is, so that a missing
    path (``/srv/x``, ``./x``, ``~/x``, ``a/b/c``, ``dir/x.tar.gz``) still says it is missing."""
    if _looks_like_a_hub_id(source) and not Path(source).exists():
        return "hf://" + source
    return source


def admit_client_source(source: str, local_roots: Sequence[Path]) -> str:
    """``source`` as an admin client may send it, else ``SourceNotAllowed`` (or
    ``SourceError`` for an address of a kind no source module reads).

    hf://, http(s):// and tinker:// sources pass as they are (``source_networks`` checks
    where they lead). A local path must lie under ``local_roots`` (``admit_local_path``) and
    comes back resolved, so that what is fetched is what was checked. A bare ``ORG/REPO`` is
    a local path only when it names one under a root; else it is the hub's, whether or not
    such a path exists elsewhere, so it tells nothing of the files outside the roots.
    """
    if source.startswith(_REMOTE_SCHEMES):
        return source
    if _OTHER_SCHEME.match(source) and not source.startswith("file://"):
        raise SourceError(
            f"adapter source {source!r} is not a local path, nor an hf://, https:// or "
            "tinker:// address"
        )
    if _looks_like_a_hub_id(source):
        local = resolved_under(source, local_roots)
        if local is None or not local.exists():
            return "hf://" + source
    return str(admit_local_path(source, local_roots))


def _looks_like_a_hub_id(source: str) -> bool:
    return bool(_BARE_HUB_ID.match(source)) and not source.lower().endswith(_ARCHIVE_SUFFIXES)


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
    source = hub_source_of(source)
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
    source = hub_source_of(source)
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
