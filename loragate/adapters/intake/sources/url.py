"""``https://`` / ``http://`` sources: an archive, streamed with a size cap and resumed on
retry; its change marker is the ETag or Last-Modified. Tinker checkpoints arrive this way too,
through signed URLs."""

from __future__ import annotations

import hashlib
from pathlib import Path

from loragate.adapters.intake.archives import extract_archive
from loragate.adapters.intake.downloads import download_file, head_validator
from loragate.adapters.intake.sources.fetched import FetchedSource, FetchLimits, adapter_root
from loragate.adapters.provenance import Provenance


def fetch_url(url: str, dest: Path, progress: bool, limits: FetchLimits) -> FetchedSource:
    path, etag = fetch_archive_url(url, url, dest, progress, limits)
    return FetchedSource(path, "url", Provenance(url, revision=etag, fingerprint=etag), etag=etag)


def url_fingerprint(url: str, timeout: float) -> str | None:
    """The URL's ETag or Last-Modified, from a HEAD request."""
    return head_validator(url, timeout=timeout)


def fetch_archive_url(
    url: str, key: str, dest: Path, progress: bool, limits: FetchLimits
) -> tuple[Path, str | None]:
    """Download the archive at ``url`` and unpack it into ``dest``.

    ``key`` names the partial download that a retry resumes. Returns the adapter's directory
    and the response's ETag (or Last-Modified).
    """
    target = _download_target(key, limits.download_dir)
    done = download_file(
        url,
        target,
        max_bytes=limits.max_bytes,
        timeout=limits.timeout,
        deadline=limits.deadline,
        progress=progress,
    )
    try:
        extract_archive(done.path, dest, max_bytes=limits.max_bytes, max_members=limits.max_members)
    finally:
        done.path.unlink(missing_ok=True)
    return adapter_root(dest), done.etag or done.last_modified


def _download_target(key: str, download_dir: Path) -> Path:
    # A partial download resumes only for the same key: the full URL (query included, since
    # it can select other content), or a Tinker path whose signed URLs change every time.
    return download_dir / f".download-{hashlib.sha256(key.encode()).hexdigest()[:24]}.archive"
