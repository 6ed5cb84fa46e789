"""What every source scheme shares: the result of a fetch, the limits a fetch runs under, and
where in the fetched tree the adapter lies (their error is ``loragate.fetching.SourceError``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loragate.adapters.intake.downloads import DEFAULT_DEADLINE
from loragate.adapters.provenance import Provenance


@dataclass(frozen=True)
class FetchedSource:
    path: Path  # the local directory holding the adapter (or Vi run)
    kind: str  # "local", "archive", "hf", "url" or "tinker"
    # The source as given, what was fetched, and its change marker: passed on unchanged to
    # the store and the manifest.
    provenance: Provenance
    etag: str | None = None
    commit: str | None = None
    # The chat format the adapter was trained with, where the source says (a Tinker run's
    # ``renderer_name``): the version's preset carries it when nothing else names one.
    renderer: str | None = None


@dataclass(frozen=True)
class FetchLimits:
    max_bytes: int
    max_members: int
    timeout: float
    download_dir: Path
    deadline: float = DEFAULT_DEADLINE


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
