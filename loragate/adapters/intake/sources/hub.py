"""``hf://ORG/REPO[@REV][/SUBDIR]`` sources: a Hugging Face repo, pinned to the commit it
resolved to; its change marker is that commit. The hub helpers (addresses, token, endpoint
check) are ``loragate.fetching.hub``'s, shared with base-model and GGUF downloads."""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from pathlib import Path

from loragate.adapters.intake.sources.fetched import FetchedSource, adapter_root
from loragate.adapters.provenance import Provenance
from loragate.fetching import SourceError
from loragate.fetching.hub import check_hub_endpoint, hf_token, parse_hf_source
from loragate.fetching.progress import hub_progress_class

_SHA = re.compile(r"^[0-9a-f]{40}$")


def fetch_hf(
    source: str,
    dest: Path,
    revision: str | None,
    progress: bool,
    cache_dir: Path | None,
    max_bytes: int,
) -> FetchedSource:
    """Copy the repo (or its SUBDIR) at the revision into ``dest``, from the hub cache.

    The repo comes from the user's Hugging Face hub cache (downloaded there when missing),
    or from ``cache_dir`` when an earlier loragate downloaded it there. The files may total
    at most ``max_bytes``, the cap of archive downloads: refused before anything is
    downloaded when the hub lists larger files, and while copying otherwise (a cached repo,
    a hub that lists no sizes).
    """
    repo, rev_in_source, sub = parse_hf_source(source)
    rev = _pick_revision(source, rev_in_source, revision)
    check_hub_endpoint()
    _refuse_listed_size(source, repo, rev, sub, max_bytes)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from loragate.base_model.hub_cache import hub_cache_holding

    try:
        snapshot = Path(
            snapshot_download(
                repo,
                revision=rev,
                cache_dir=hub_cache_holding(repo, cache_dir),
                allow_patterns=[f"{sub}/**", f"{sub}/*"] if sub else None,
                token=hf_token(),
                tqdm_class=hub_progress_class(),
            )
        )
    except LocalEntryNotFoundError as exc:
        raise SourceError(
            f"{source} is not in the local Hugging Face cache and the hub cannot be reached "
            f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '')!r}): {exc}"
        ) from exc
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise  # the disk, not the source: the pipeline answers it as such (507)
        raise SourceError(f"cannot download {source} from Hugging Face: {exc}") from exc
    except Exception as exc:  # auth, not found, network: the hub raises many kinds
        raise SourceError(f"cannot download {source} from Hugging Face: {exc}") from exc
    commit = snapshot.name if _SHA.match(snapshot.name) else None
    found = snapshot / sub if sub else snapshot
    if not found.is_dir():
        raise SourceError(f"{source}: the repository has no directory {sub!r} at this revision")
    _copy_tree(found, dest, source, max_bytes)
    provenance = Provenance(source, revision=commit or rev, fingerprint=commit)
    return FetchedSource(adapter_root(dest), "hf", provenance, commit=commit)


def hf_fingerprint(source: str, revision: str | None) -> str | None:
    """The commit sha the revision points at now (one hub API call; none for a sha)."""
    repo, rev_in_source, _sub = parse_hf_source(source)
    rev = _pick_revision(source, rev_in_source, revision)
    if rev and _SHA.match(rev):
        return rev  # a commit never moves
    check_hub_endpoint()
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(repo, revision=rev, token=hf_token())
    except Exception as exc:
        raise SourceError(f"cannot ask Hugging Face about {source}: {exc}") from exc
    return str(info.sha) if info.sha else None


def _pick_revision(source: str, in_source: str | None, given: str | None) -> str | None:
    if in_source and given and in_source != given:
        raise SourceError(
            f"{source!r} pins revision {in_source!r} but revision {given!r} was also asked for"
        )
    return in_source or given


def _refuse_listed_size(
    source: str, repo: str, rev: str | None, sub: str | None, max_bytes: int
) -> None:
    """Refuse ``source`` when the hub lists its files as more than ``max_bytes`` together.

    One listing call, before any download. When the hub cannot be asked (offline, no
    token, down), the download decides and ``_copy_tree`` counts what arrived.
    """
    from huggingface_hub import HfApi, constants
    from huggingface_hub.hf_api import RepoFile

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        return  # nothing will be downloaded: only the hub cache can answer
    try:
        listed = HfApi().list_repo_tree(
            repo, path_in_repo=sub, recursive=True, revision=rev, token=hf_token()
        )
        total = sum(item.size or 0 for item in listed if isinstance(item, RepoFile))
    except Exception:  # the hub raises many kinds; snapshot_download reports them better
        return
    if total > max_bytes:
        raise SourceError(
            f"{source} holds {total} bytes of files, more than the limit of {max_bytes} bytes "
            "for an adapter; point at the adapter's own subdirectory (hf://ORG/REPO/SUBDIR) "
            "or raise the limit if this is intended"
        )


def _copy_tree(src: Path, dest: Path, source: str, max_bytes: int) -> None:
    """Copy ``src`` (following the hub cache's symlinks) to ``dest``, all or nothing, refusing
    more than ``max_bytes`` in all."""
    if dest.exists() and any(dest.iterdir()):
        raise SourceError(f"cannot fetch into {dest}: it is not empty")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.copy-", dir=dest.parent))
    copied = 0

    def copy_within_cap(from_path: str, to_path: str) -> object:
        nonlocal copied
        copied += os.stat(from_path).st_size
        if copied > max_bytes:
            raise SourceError(
                f"{source} holds more than the limit of {max_bytes} bytes for an adapter; "
                "point at the adapter's own subdirectory (hf://ORG/REPO/SUBDIR) or raise "
                "the limit if this is intended"
            )
        return shutil.copy2(from_path, to_path)

    try:
        shutil.copytree(
            src,
            staging / "tree",
            ignore=shutil.ignore_patterns(".cache", ".git"),
            copy_function=copy_within_cap,
        )
        if dest.exists():
            dest.rmdir()
        (staging / "tree").rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
