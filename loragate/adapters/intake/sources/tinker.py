"""``tinker://RUN/sampler_weights/NAME`` sources (or ``weights``, ``external_weights``; NAME
may be ``latest``): a Tinker checkpoint, through the ``tinker`` SDK. Its change marker is the
newest checkpoint of the path's kind (for ``latest``) or the named checkpoint's time."""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from loragate.adapters.intake.downloads import download_file
from loragate.adapters.intake.sources.fetched import FetchedSource, FetchLimits, adapter_root
from loragate.adapters.intake.sources.url import fetch_archive_url
from loragate.adapters.provenance import Provenance
from loragate.fetching import SourceError
from loragate.fetching.source_networks import (
    SourceAddressRefused,
    check_source_url,
    source_client,
)

log = logging.getLogger("loragate.adapters")

TINKER_EXTRA_HINT = "pip install 'loragate[tinker]'"
# Where tinker-cookbook records a run's renderer, in the training run's user_metadata.
TINKER_RENDERER_KEY = "renderer_name"
TINKER_DEFAULT_BASE_URL = "https://tinker.thinkingmachines.dev/services/tinker-prod"
TINKER_SEGMENTS = {
    "sampler_weights": "sampler",
    "weights": "training",
    "external_weights": "external",
}
_TINKER = re.compile(r"^tinker://(?P<run>[^/\s]+)/(?P<segment>[a-z_]+)/(?P<name>[^/\s]+)$")


def parse_tinker_source(source: str) -> tuple[str, str, str]:
    """``(run_id, segment, name)`` of ``tinker://RUN/SEGMENT/NAME``."""
    match = _TINKER.match(source)
    if match is None or match["segment"] not in TINKER_SEGMENTS:
        raise SourceError(
            f"{source!r} is not a Tinker checkpoint path: expected "
            "tinker://RUN/sampler_weights/NAME (or weights/NAME, external_weights/NAME)"
        )
    return match["run"], match["segment"], match["name"]


def fetch_tinker(source: str, dest: Path, progress: bool, limits: FetchLimits) -> FetchedSource:
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
        root, _ = fetch_archive_url(url, path, dest, progress, limits)
    marker = _tinker_marker(checkpoints, source, name)
    return FetchedSource(
        root,
        "tinker",
        Provenance(source, revision=path, fingerprint=marker),
        renderer=_tinker_renderer(rest, run),
    )


def _tinker_renderer(rest: Any, run: str) -> str | None:
    """The renderer (chat format) the run was trained with: the ``renderer_name`` that
    tinker-cookbook puts in the training run's ``user_metadata``
    (``tinker_cookbook/checkpoint_utils.py``: ``RENDERER_NAME_METADATA_KEY``); None when the
    run does not say, or cannot be asked (the weights are fetched all the same)."""
    if not hasattr(rest, "get_training_run"):
        return None
    try:
        training_run = _tinker_result(rest.get_training_run(run))
    except Exception as exc:  # the SDK's own errors: the renderer is a nicety, not the adapter
        log.info("Tinker run %s: no training run metadata (%s)", run, exc)
        return None
    metadata = getattr(training_run, "user_metadata", None) or {}
    renderer = metadata.get(TINKER_RENDERER_KEY) if isinstance(metadata, dict) else None
    return renderer if isinstance(renderer, str) and renderer.strip() else None


def tinker_fingerprint(source: str) -> str | None:
    run, segment, name = parse_tinker_source(source)
    rest = _tinker_rest_client(_import_tinker())
    return _tinker_marker(_try_list_checkpoints(rest, run, segment), source, name)


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
        check_source_url(_tinker_base_url())  # the SDK connects there on its own
    except SourceAddressRefused as exc:
        raise SourceError(f"the Tinker endpoint: {exc}") from exc
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


def _try_list_checkpoints(rest: Any, run: str, segment: str) -> list[Any]:
    if not hasattr(rest, "list_checkpoints"):
        return []
    try:
        return _tinker_checkpoints(rest, run, segment)
    except Exception as exc:
        raise SourceError(f"cannot list the checkpoints of Tinker run {run}: {exc}") from exc


def _tinker_checkpoints(rest: Any, run: str, segment: str) -> list[Any]:
    listed = _tinker_result(rest.list_checkpoints(run))
    wanted = TINKER_SEGMENTS[segment]
    found = [
        c
        for c in getattr(listed, "checkpoints", [])
        if getattr(c, "checkpoint_type", None) == wanted
    ]
    return sorted(found, key=lambda c: str(getattr(c, "time", "")))


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
        with source_client(60.0, follow_redirects=False) as http:
            response = http.get(route, headers={"X-API-Key": api_key, "Accept": "application/gzip"})
    except SourceAddressRefused as exc:
        raise SourceError(f"Tinker at {base_url}: {exc}") from exc
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


def _fetch_tinker_files(
    rest: Any, path: str, dest: Path, progress: bool, limits: FetchLimits
) -> Path:
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
