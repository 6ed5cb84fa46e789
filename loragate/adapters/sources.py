"""Fetch an adapter from where the user keeps it into a local directory.

Source forms:

- a local directory (used in place) or a local ``.tar`` / ``.tar.gz`` / ``.tgz`` / ``.zip``;
- ``hf://ORG/REPO[@REV][/SUBDIR]``: a Hugging Face repo, pinned to the commit it resolved to;
- ``https://...`` / ``http://...``: an archive, streamed with a size cap and resumed on retry;
- ``tinker://RUN/sampler_weights/NAME`` (or ``weights``, ``external_weights``; NAME may be
  ``latest``): a Tinker checkpoint, through the ``tinker`` SDK.

``source_fingerprint`` gives a cheap marker that changes when the source does, for
follow mode: it never downloads the adapter itself.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loragate.adapters.archives import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_MEMBERS,
    UnsafeArchiveError,
    archive_kind,
    extract_archive,
)
from loragate.adapters.downloads import (
    DEFAULT_DEADLINE,
    DEFAULT_TIMEOUT,
    DownloadError,
    download_file,
    head_validator,
)

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip")
TINKER_EXTRA_HINT = "pip install 'loragate[tinker]'"
TINKER_DEFAULT_BASE_URL = "https://tinker.thinkingmachines.dev/services/tinker-prod"
TINKER_SEGMENTS = {
    "sampler_weights": "sampler",
    "weights": "training",
    "external_weights": "external",
}
_HF = re.compile(r"^hf://(?P<repo>[^/@\s]+/[^/@\s]+)(?:@(?P<rev>[^/\s]+))?(?:/(?P<sub>.+))?$")
_TINKER = re.compile(r"^tinker://(?P<run>[^/\s]+)/(?P<segment>[a-z_]+)/(?P<name>[^/\s]+)$")
_SHA = re.compile(r"^[0-9a-f]{40}$")


class SourceError(ValueError):
    """The source cannot be fetched; the message says why and what to do."""


@dataclass(frozen=True)
class FetchedSource:
    path: Path  # the local directory holding the adapter (or Vi run)
    source: str  # the source string as given
    kind: str  # "local", "archive", "hf", "url" or "tinker"
    revision: str | None = None  # what was fetched: HF commit sha, Tinker path, ETag, ...
    etag: str | None = None
    commit: str | None = None
    # What source_fingerprint() returns for this source now: follow mode compares the two.
    fingerprint: str | None = None


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
    and unpacked) and ``max_members``; each http(s) download must finish within ``deadline``
    seconds. ``hf://`` repos come from the user's Hugging Face hub cache (downloaded there
    when missing), or from ``hf_cache_dir`` when an earlier loragate downloaded them there.
    """
    limits = _Limits(max_bytes, max_members, timeout, download_dir or dest.parent, deadline)
    try:
        if source.startswith("hf://"):
            return _fetch_hf(source, dest, revision, progress, hf_cache_dir)
        if source.startswith(("https://", "http://")):
            return _fetch_url(source, dest, progress, limits)
        if source.startswith("tinker://"):
            return _fetch_tinker(source, dest, progress, limits)
        return _fetch_local(source, dest, limits)
    except (UnsafeArchiveError, DownloadError) as exc:
        raise SourceError(str(exc)) from exc


@dataclass(frozen=True)
class _Limits:
    max_bytes: int
    max_members: int
    timeout: float
    download_dir: Path
    deadline: float = DEFAULT_DEADLINE


# -- local -----------------------------------------------------------------------------------


def _local_path(source: str) -> Path:
    try:
        return Path(source.removeprefix("file://")).expanduser()
    except RuntimeError:  # ~user for a user that does not exist
        raise SourceError(
            f"adapter source {source!r} names the home directory of an unknown user"
        ) from None


def _fetch_local(source: str, dest: Path, limits: _Limits) -> FetchedSource:
    path = _local_path(source)
    if path.is_dir():
        marker = _dir_fingerprint(path)
        return FetchedSource(path.resolve(), source, "local", revision=marker, fingerprint=marker)
    if path.is_file():
        if archive_kind(path) is None:
            raise SourceError(
                f"{path} is not a directory or a {', '.join(ARCHIVE_SUFFIXES)} archive"
            )
        extract_archive(path, dest, max_bytes=limits.max_bytes, max_members=limits.max_members)
        marker = _file_fingerprint(path)
        return FetchedSource(
            adapter_root(dest), source, "archive", revision=marker, fingerprint=marker
        )
    raise SourceError(
        f"adapter source {source!r} is not an existing directory or archive, nor an hf://, "
        "https:// or tinker:// address"
    )


def adapter_root(directory: Path) -> Path:
    """The directory inside an unpacked archive that holds the adapter.

    Archives often wrap their files in one top-level folder; descend through such folders.
    """
    current = directory
    for _ in range(4):
        entries = [p for p in current.iterdir() if not p.name.startswith(".")]
        if len(entries) != 1 or not entries[0].is_dir():
            break
        current = entries[0]
    return current


def _file_fingerprint(path: Path) -> str:
    stat = path.stat()
    return f"{stat.st_size}-{stat.st_mtime_ns}"


_MAX_DIR_ENTRIES = 10_000
# What an adapter directory (any supported layout) holds at its top level.
_ADAPTER_MARKERS = ("adapter_config.json", "adapters.safetensors", "model_adapter", "model_full")


def _dir_fingerprint(path: Path) -> str:
    """A change marker for a local adapter dir: names, sizes and mtimes of what it holds."""
    if not any((path / marker).exists() for marker in _ADAPTER_MARKERS):
        raise SourceError(
            f"{path} does not look like an adapter directory (no adapter_config.json, "
            "adapters.safetensors or Vi run layout in it)"
        )
    digest = hashlib.sha256()
    seen = 0
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            seen += 1
            if seen > _MAX_DIR_ENTRIES:
                raise SourceError(
                    f"{path} holds more than {_MAX_DIR_ENTRIES} files: not an adapter"
                )
            full = Path(root) / name
            try:
                stat = full.lstat()  # a dangling symlink is described, not followed
            except OSError as exc:
                raise SourceError(f"cannot read {full}: {exc.strerror}") from None
            rel = full.relative_to(path).as_posix()
            digest.update(f"{rel}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


# -- Hugging Face ----------------------------------------------------------------------------


def parse_hf_source(source: str) -> tuple[str, str | None, str | None]:
    """``(repo_id, revision, subdir)`` of ``hf://ORG/REPO[@REV][/SUBDIR]``."""
    match = _HF.match(source)
    if match is None:
        raise SourceError(f"{source!r} is not of the form hf://ORG/REPO[@REVISION][/SUBDIR]")
    sub = match["sub"].strip("/") if match["sub"] else None
    if sub and ".." in Path(sub).parts:
        raise SourceError(f"{source!r}: the subdirectory may not contain '..'")
    return match["repo"], match["rev"], sub or None


def hf_token() -> str | None:
    """The Hugging Face token from ``HF_TOKEN``, or None to let huggingface_hub find one."""
    return os.environ.get("HF_TOKEN") or None


def hf_progress_class(progress: bool) -> Any:
    """A ``tqdm_class`` for ``snapshot_download``: None (the hub's bars) or a silent one."""
    if progress:
        return None
    from tqdm.auto import tqdm

    class Silent(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


def _pick_revision(source: str, in_source: str | None, given: str | None) -> str | None:
    if in_source and given and in_source != given:
        raise SourceError(
            f"{source!r} pins revision {in_source!r} but revision {given!r} was also asked for"
        )
    return in_source or given


def _fetch_hf(
    source: str, dest: Path, revision: str | None, progress: bool, cache_dir: Path | None
) -> FetchedSource:
    repo, rev_in_source, sub = parse_hf_source(source)
    rev = _pick_revision(source, rev_in_source, revision)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from loragate.adapters.model_cache import hub_cache_holding

    try:
        snapshot = Path(
            snapshot_download(
                repo,
                revision=rev,
                cache_dir=hub_cache_holding(repo, cache_dir),
                allow_patterns=[f"{sub}/**", f"{sub}/*"] if sub else None,
                token=hf_token(),
                tqdm_class=hf_progress_class(progress),
            )
        )
    except LocalEntryNotFoundError as exc:
        raise SourceError(
            f"{source} is not in the local Hugging Face cache and the hub cannot be reached "
            f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '')!r}): {exc}"
        ) from exc
    except Exception as exc:  # auth, not found, network: the hub raises many kinds
        raise SourceError(f"cannot download {source} from Hugging Face: {exc}") from exc
    commit = snapshot.name if _SHA.match(snapshot.name) else None
    found = snapshot / sub if sub else snapshot
    if not found.is_dir():
        raise SourceError(f"{source}: the repository has no directory {sub!r} at this revision")
    _copy_tree(found, dest)
    return FetchedSource(
        adapter_root(dest), source, "hf", revision=commit or rev, commit=commit, fingerprint=commit
    )


def _copy_tree(src: Path, dest: Path) -> None:
    """Copy ``src`` (following the hub cache's symlinks) to ``dest``, all or nothing."""
    if dest.exists() and any(dest.iterdir()):
        raise SourceError(f"cannot fetch into {dest}: it is not empty")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.copy-", dir=dest.parent))
    try:
        shutil.copytree(src, staging / "tree", ignore=shutil.ignore_patterns(".cache", ".git"))
        if dest.exists():
            dest.rmdir()
        (staging / "tree").rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# -- HTTP ------------------------------------------------------------------------------------


def _download_target(key: str, download_dir: Path) -> Path:
    # A partial download resumes only for the same key: the full URL (query included, since
    # it can select other content), or a Tinker path whose signed URLs change every time.
    return download_dir / f".download-{hashlib.sha256(key.encode()).hexdigest()[:24]}.archive"


def _fetch_archive_url(
    url: str, key: str, dest: Path, progress: bool, limits: _Limits
) -> tuple[Path, str | None]:
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


def _fetch_url(url: str, dest: Path, progress: bool, limits: _Limits) -> FetchedSource:
    path, etag = _fetch_archive_url(url, url, dest, progress, limits)
    return FetchedSource(path, url, "url", revision=etag, etag=etag, fingerprint=etag)


# -- Tinker ----------------------------------------------------------------------------------


def parse_tinker_source(source: str) -> tuple[str, str, str]:
    """``(run_id, segment, name)`` of ``tinker://RUN/SEGMENT/NAME``."""
    match = _TINKER.match(source)
    if match is None or match["segment"] not in TINKER_SEGMENTS:
        raise SourceError(
            f"{source!r} is not a Tinker checkpoint path: expected "
            "tinker://RUN/sampler_weights/NAME (or weights/NAME, external_weights/NAME)"
        )
    return match["run"], match["segment"], match["name"]


def _import_tinker() -> Any:
    try:
        import tinker
    except ImportError as exc:
        raise SourceError(
            f"tinker:// sources need the Tinker SDK: {TINKER_EXTRA_HINT} (and set TINKER_API_KEY)"
        ) from exc
    return tinker


def _tinker_rest_client(tinker: Any) -> Any:
    try:
        if hasattr(tinker, "RestClient"):
            return tinker.RestClient()
        return tinker.ServiceClient().create_rest_client()
    except Exception as exc:
        raise SourceError(
            f"cannot start the Tinker SDK client (is TINKER_API_KEY set?): {exc}"
        ) from exc


def _tinker_result(future: Any) -> Any:
    return future.result() if hasattr(future, "result") else future


def _tinker_checkpoints(rest: Any, run: str, segment: str) -> list[Any]:
    listed = _tinker_result(rest.list_checkpoints(run))
    wanted = TINKER_SEGMENTS[segment]
    found = [
        c
        for c in getattr(listed, "checkpoints", [])
        if getattr(c, "checkpoint_type", None) == wanted
    ]
    return sorted(found, key=lambda c: str(getattr(c, "time", "")))


def _fetch_tinker(source: str, dest: Path, progress: bool, limits: _Limits) -> FetchedSource:
    run, segment, name = parse_tinker_source(source)
    rest = _tinker_rest_client(_import_tinker())
    try:
        checkpoints = _try_list_checkpoints(rest, run, segment)
    except SourceError:
        if name == "latest":
            raise
        checkpoints = []  # only the change marker needs the list
    if name == "latest":
        if not checkpoints:
            raise SourceError(
                f"Tinker run {run} has no {segment} checkpoints (or they cannot be listed)"
            )
        path = str(checkpoints[-1].tinker_path)
    else:
        path = source
    if segment == "external_weights":
        root = _fetch_tinker_files(rest, path, dest, progress, limits)
    else:
        url = _tinker_archive_url(rest, path)
        root, _ = _fetch_archive_url(url, path, dest, progress, limits)
    marker = _tinker_marker(checkpoints, source, name)
    return FetchedSource(root, source, "tinker", revision=path, fingerprint=marker)


def _try_list_checkpoints(rest: Any, run: str, segment: str) -> list[Any]:
    if not hasattr(rest, "list_checkpoints"):
        return []
    try:
        return _tinker_checkpoints(rest, run, segment)
    except Exception as exc:
        raise SourceError(f"cannot list the checkpoints of Tinker run {run}: {exc}") from exc


def _tinker_marker(checkpoints: list[Any], source: str, name: str) -> str | None:
    if name != "latest":
        checkpoints = [c for c in checkpoints if str(getattr(c, "tinker_path", "")) == source]
    if not checkpoints:
        return None
    newest = checkpoints[-1]
    return f"{newest.tinker_path}@{getattr(newest, 'time', '')}"


def _tinker_archive_url(rest: Any, path: str) -> str:
    """The signed URL of the checkpoint's tar archive."""
    if hasattr(rest, "get_checkpoint_archive_url_from_tinker_path"):
        try:
            response = _tinker_result(rest.get_checkpoint_archive_url_from_tinker_path(path))
        except Exception as exc:
            raise SourceError(f"Tinker could not give an archive for {path}: {exc}") from exc
        return str(response.url)
    # Newer SDKs dropped the archive method; the REST route it called is still the way to
    # a sampler checkpoint's archive: a 302 to a signed URL.
    return _tinker_archive_url_rest(path)


def _tinker_archive_url_rest(path: str) -> str:
    import httpx

    run, segment, name = parse_tinker_source(path)
    base_url = _tinker_base_url()
    api_key = _tinker_api_key()
    route = f"{base_url}/api/v1/training_runs/{run}/checkpoints/{segment}/{name}/archive"
    try:
        response = httpx.get(
            route,
            headers={"X-API-Key": api_key, "Accept": "application/gzip"},
            follow_redirects=False,
            timeout=60.0,
        )
    except httpx.HTTPError as exc:
        raise SourceError(f"cannot reach Tinker at {base_url}: {exc}") from exc
    if response.status_code in (301, 302, 303, 307, 308) and response.headers.get("Location"):
        return response.headers["Location"]
    if response.status_code == 200 and "json" in response.headers.get("Content-Type", ""):
        url = response.json().get("url")
        if url:
            return str(url)
    raise SourceError(
        f"Tinker gave no archive for {path} (HTTP {response.status_code}: "
        f"{response.text[:200]}); check the path with `tinker checkpoint list`, or export the "
        "weights with save_weights_external and use tinker://RUN/external_weights/NAME"
    )


def _tinker_base_url() -> str:
    try:
        from tinker.lib.base_url import resolve_base_url

        return str(resolve_base_url(None))
    except ImportError:
        return (os.environ.get("TINKER_BASE_URL") or TINKER_DEFAULT_BASE_URL).rstrip("/")


def _tinker_api_key() -> str:
    key = os.environ.get("TINKER_API_KEY")
    if not key:
        try:
            from tinker.auth import get_tinker_token

            key = get_tinker_token()
        except ImportError:
            key = None
    if not key:
        raise SourceError("tinker:// sources need a Tinker API key: set TINKER_API_KEY")
    return key


def _fetch_tinker_files(rest: Any, path: str, dest: Path, progress: bool, limits: _Limits) -> Path:
    """Download an external-weights checkpoint, one signed URL per file."""
    if not hasattr(rest, "get_external_weights_urls"):
        raise SourceError(
            f"this Tinker SDK cannot download external weights; upgrade it ({TINKER_EXTRA_HINT} -U)"
        )
    try:
        urls: dict[str, str] = dict(_tinker_result(rest.get_external_weights_urls(path)).urls)
    except Exception as exc:
        raise SourceError(f"Tinker could not list the files of {path}: {exc}") from exc
    if not urls:
        raise SourceError(f"Tinker checkpoint {path} has no files")
    if len(urls) > limits.max_members:
        raise SourceError(
            f"Tinker checkpoint {path} has {len(urls)} files, more than {limits.max_members}"
        )
    if dest.exists() and any(dest.iterdir()):
        raise SourceError(f"cannot fetch into {dest}: it is not empty")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tinker-", dir=dest.parent))
    try:
        budget = limits.max_bytes
        ends = time.monotonic() + limits.deadline  # one deadline for all the files together
        for name, url in sorted(urls.items()):
            relative = Path(name)
            if relative.is_absolute() or ".." in relative.parts or not relative.parts:
                raise SourceError(
                    f"Tinker checkpoint {path} names an unsafe file {name!r}; refused"
                )
            done = download_file(
                url,
                staging / relative,
                max_bytes=budget,
                timeout=limits.timeout,
                deadline=max(ends - time.monotonic(), 0.001),
                progress=progress,
            )
            budget -= done.size
        if dest.exists():
            dest.rmdir()
        staging.rename(dest)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return adapter_root(dest)


# -- fingerprints ----------------------------------------------------------------------------


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
            return _hf_fingerprint(source, revision)
        if source.startswith(("https://", "http://")):
            return head_validator(source, timeout=timeout)
        if source.startswith("tinker://"):
            return _tinker_fingerprint(source)
    except DownloadError as exc:
        raise SourceError(str(exc)) from exc
    path = _local_path(source)
    if path.is_dir():
        return _dir_fingerprint(path)
    if path.is_file():
        return _file_fingerprint(path)
    raise SourceError(f"adapter source {source!r} does not exist")


def _hf_fingerprint(source: str, revision: str | None) -> str | None:
    repo, rev_in_source, _sub = parse_hf_source(source)
    rev = _pick_revision(source, rev_in_source, revision)
    if rev and _SHA.match(rev):
        return rev  # a commit never moves
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(repo, revision=rev, token=hf_token())
    except Exception as exc:
        raise SourceError(f"cannot ask Hugging Face about {source}: {exc}") from exc
    return str(info.sha) if info.sha else None


def _tinker_fingerprint(source: str) -> str | None:
    run, segment, name = parse_tinker_source(source)
    rest = _tinker_rest_client(_import_tinker())
    return _tinker_marker(_try_list_checkpoints(rest, run, segment), source, name)
