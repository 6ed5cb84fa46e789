"""The Hugging Face hub as every download from it sees it (adapter sources, base models, GGUF
files): ``hf://ORG/REPO[@REV][/SUBDIR]`` addresses, the token, and the endpoint check. The
bytes downloaded feed the current progress record (``progress.hub_progress_class``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from loragate.fetching import SourceError

_HF = re.compile(r"^hf://(?P<repo>[^/@\s]+/[^/@\s]+)(?:@(?P<rev>[^/\s]+))?(?:/(?P<sub>.+))?$")


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


def check_hub_endpoint() -> None:
    """Refuse an ``HF_ENDPOINT`` that is a loopback, private or link-local address not in
    ``allowed_source_networks`` (huggingface_hub connects there on its own)."""
    endpoint = os.environ.get("HF_ENDPOINT")
    if not endpoint or os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        return  # the default endpoint is the public hub; offline, nothing connects
    from loragate.fetching.source_networks import SourceAddressRefused, check_source_url

    try:
        check_source_url(endpoint)
    except SourceAddressRefused as exc:
        raise SourceError(f"HF_ENDPOINT: {exc}") from exc
