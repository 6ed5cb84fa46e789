"""``hf://ORG/REPO[@REV][/SUBDIR]`` sources: a Hugging Face repo, pinned to the commit it
resolved to; its change marker is that commit. The hub helpers (token, progress bars) are
shared with base-model and GGUF downloads."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from loragate.adapters.provenance import Provenance
from loragate.adapters.sources.fetched import FetchedSource, SourceError, adapter_root

_HF = re.compile(r"^hf://(?P<repo>[^/@\s]+/[^/@\s]+)(?:@(?P<rev>[^/\s]+))?(?:/(?P<sub>.+))?$")
_SHA = re.compile(r"^[0-9a-f]{40}$")


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


def fetch_hf(
    source: str, dest: Path, revision: str | None, progress: bool, cache_dir: Path | None
) -> FetchedSource:
    """Copy the repo (or its SUBDIR) at the revision into ``dest``, from the hub cache.

    The repo comes from the user's Hugging Face hub cache (downloaded there when missing),
    or from ``cache_dir`` when an earlier loragate downloaded it there.
    """
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
    provenance = Provenance(source, revision=commit or rev, fingerprint=commit)
    return FetchedSource(adapter_root(dest), "hf", provenance, commit=commit)


def hf_fingerprint(source: str, revision: str | None) -> str | None:
    """The commit sha the revision points at now (one hub API call; none for a sha)."""
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


def _pick_revision(source: str, in_source: str | None, given: str | None) -> str | None:
    if in_source and given and in_source != given:
        raise SourceError(
            f"{source!r} pins revision {in_source!r} but revision {given!r} was also asked for"
        )
    return in_source or given


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
