"""Download one file over HTTP(S): streamed, size-capped, resumable, with a progress bar.

The whole transfer has a deadline as well as a per-read timeout, so a server that trickles
bytes cannot hold the caller forever. Connections go only where ``source_networks`` allows
(no loopback, private or link-local address off the operator's list).
Bytes go to ``<name>.part`` beside the target, with the validator (ETag or Last-Modified)
in ``<name>.part.json``; a failed local write (a full disk) discards both. A later attempt
for the same key asks for the rest with ``Range`` + ``If-Range``: the server sends the remainder (206) if the file is unchanged,
or the whole new file (200) if it changed. The target appears only when complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from loragate.fetching.progress import report_bytes
from loragate.fetching.source_networks import source_client
from loragate.logs import redact

DEFAULT_TIMEOUT = 30.0  # seconds for one read (and to connect)
DEFAULT_DEADLINE = 3600.0  # seconds for a whole download: 2 GiB at ~600 kB/s
_CHUNK = 1 << 16


class DownloadError(ValueError):
    """The download failed or was refused; the message says what to do."""


@dataclass(frozen=True)
class Downloaded:
    path: Path
    size: int
    etag: str | None
    last_modified: str | None
    resumed: bool


def download_file(
    url: str,
    target: Path,
    *,
    max_bytes: int,
    timeout: float = DEFAULT_TIMEOUT,
    deadline: float = DEFAULT_DEADLINE,
    progress: bool = True,
    headers: dict[str, str] | None = None,
    client: httpx.Client | None = None,
) -> Downloaded:
    """Download ``url`` to ``target``, resuming a ``target.part`` left by an earlier attempt.

    Refuses (``DownloadError``) anything larger than ``max_bytes``, and gives up when the
    transfer is not done ``deadline`` seconds after it started (each read may also wait at
    most ``timeout``); an interrupted transfer keeps its ``.part`` so that calling again
    resumes it.
    """
    ends = time.monotonic() + deadline
    target.parent.mkdir(parents=True, exist_ok=True)
    # One transfer per target at a time (two adapters from one URL share it), across threads
    # and processes alike.
    with _exclusive(target.with_name(target.name + ".lock")):
        return _download(url, target, ends, deadline, max_bytes, timeout, progress, headers, client)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold ``lock_path`` (flock) for the block, and remove it after."""
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            current = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)  # the holder before us removed that file: lock the one there now
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path)
        os.close(fd)  # releases the lock


def _download(
    url: str,
    target: Path,
    ends: float,
    deadline: float,
    max_bytes: int,
    timeout: float,
    progress: bool,
    headers: dict[str, str] | None,
    client: httpx.Client | None,
) -> Downloaded:
    part = target.with_name(target.name + ".part")
    meta_path = target.with_name(target.name + ".part.json")
    offset, validator = _resume_point(part, meta_path)
    # Identity encoding: byte offsets for Range must be offsets into the file itself.
    request_headers = {"Accept-Encoding": "identity", **(headers or {})}
    if offset and validator:
        request_headers["Range"] = f"bytes={offset}-"
        request_headers["If-Range"] = validator
    own_client = client is None
    # No single read may outlast the deadline either.
    http = client or source_client(min(timeout, deadline))
    try:
        with http.stream("GET", url, headers=request_headers) as response:
            if response.status_code == 416 and offset:
                # Nothing left to send: the part may already be whole, else start over.
                total = _range_total(response.headers.get("Content-Range"))
                if total != offset:
                    _discard(part, meta_path)
                    raise DownloadError(
                        f"the server refused to resume {redact(url)}; the partial download was "
                        "discarded, try again"
                    )
                return _finish(part, meta_path, target, response, resumed=True)
            if response.status_code >= 400:
                raise DownloadError(
                    f"GET {redact(url)} answered HTTP {response.status_code}; check the URL and "
                    "that the file is still available"
                )
            resumed = response.status_code == 206
            if not resumed:
                offset = 0
            elif _range_start(response.headers.get("Content-Range")) != offset:
                _discard(part, meta_path)
                raise DownloadError(
                    f"the server resumed {redact(url)} at the wrong offset; try again"
                )
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and offset + int(length) > max_bytes:
                raise DownloadError(
                    f"{redact(url)} is {offset + int(length)} bytes, more than the limit of "
                    f"{max_bytes} bytes; raise the limit if this is intended"
                )
            meta = {
                "url": redact(url),
                "etag": response.headers.get("ETag"),
                "last_modified": response.headers.get("Last-Modified"),
            }
            meta_path.write_text(json.dumps(meta))
            total = offset + int(length) if length is not None and length.isdigit() else None
            _stream_to(part, response, offset, total, max_bytes, url, progress, (ends, deadline))
            return _finish(part, meta_path, target, response, resumed=resumed)
    except httpx.TimeoutException as exc:
        raise DownloadError(
            f"downloading {redact(url)} timed out ({exc.__class__.__name__}); run it again to "
            "resume where it stopped"
        ) from exc
    except httpx.HTTPError as exc:
        raise DownloadError(
            f"downloading {redact(url)} failed ({exc.__class__.__name__}: {exc}); run it again "
            "to resume where it stopped"
        ) from exc
    except OSError:
        # Writing here failed (a full disk, most often; the network's errors are httpx's):
        # a partial file would only hold on to the space that is missing. The caller turns
        # the error into what a client sees ("no space left on device").
        _discard(part, meta_path)
        raise
    finally:
        if own_client:
            http.close()


def _resume_point(part: Path, meta_path: Path) -> tuple[int, str | None]:
    meta = _read_meta(meta_path)
    validator = meta.get("etag") or meta.get("last_modified")
    if not part.is_file() or not validator:
        # Without a validator a resumed file could mix two versions; start over.
        _discard(part, meta_path)
        return 0, None
    return part.stat().st_size, str(validator)


def _read_meta(meta_path: Path) -> dict[str, Any]:
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _stream_to(
    part: Path,
    response: httpx.Response,
    offset: int,
    total: int | None,
    max_bytes: int,
    url: str,
    progress: bool,
    deadline: tuple[float, float],
) -> None:
    from tqdm.auto import tqdm

    ends, seconds = deadline
    size = offset
    mode = "ab" if offset else "wb"
    with (
        part.open(mode) as sink,
        tqdm(
            total=total,
            initial=offset,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=Path(urlsplit(url).path).name or "download",
            disable=not progress,
        ) as bar,
    ):
        for block in response.iter_raw():  # unchunked: keep every byte that arrived
            size += len(block)
            if size > max_bytes:
                sink.close()
                _discard(part, part.with_name(part.name + ".json"))
                raise DownloadError(
                    f"{redact(url)} is larger than the limit of {max_bytes} bytes; raise the "
                    "limit if this is intended"
                )
            sink.write(block)
            bar.update(len(block))
            report_bytes(size, total)
            if time.monotonic() > ends:
                raise DownloadError(
                    f"downloading {redact(url)} did not finish within {seconds:g} s ({size} of "
                    f"{total if total is not None else 'an unknown number of'} bytes arrived); "
                    "run it again to resume where it stopped"
                )
    if total is not None and size != total:
        raise DownloadError(
            f"downloading {redact(url)} stopped at {size} of {total} bytes; run it again to resume"
        )


def _finish(
    part: Path, meta_path: Path, target: Path, response: httpx.Response, *, resumed: bool
) -> Downloaded:
    meta = _read_meta(meta_path)
    os.replace(part, target)
    meta_path.unlink(missing_ok=True)
    return Downloaded(
        path=target,
        size=target.stat().st_size,
        etag=response.headers.get("ETag") or meta.get("etag"),
        last_modified=response.headers.get("Last-Modified") or meta.get("last_modified"),
        resumed=resumed,
    )


def _discard(*paths: Path) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def _range_start(header: str | None) -> int | None:
    # "bytes 100-199/200"
    try:
        return int((header or "").split()[1].split("-")[0])
    except (IndexError, ValueError):
        return None


def _range_total(header: str | None) -> int | None:
    # "bytes */200"
    try:
        return int((header or "").rsplit("/", 1)[1])
    except (IndexError, ValueError):
        return None


def head_validator(
    url: str, *, timeout: float = DEFAULT_TIMEOUT, headers: dict[str, str] | None = None
) -> str | None:
    """The ETag (else Last-Modified) of ``url`` from a HEAD request: a cheap change marker."""
    with source_client(timeout) as http:
        try:
            response = http.head(url, headers=headers)
            if response.status_code in (405, 501):  # HEAD not allowed: peek at a GET's headers
                with http.stream("GET", url, headers=headers) as streamed:
                    response = streamed
        except httpx.HTTPError as exc:
            raise DownloadError(f"cannot reach {redact(url)}: {exc}") from exc
    if response.status_code >= 400:
        raise DownloadError(f"HEAD {redact(url)} answered HTTP {response.status_code}")
    return response.headers.get("ETag") or response.headers.get("Last-Modified")
