"""The desired adapter state, persisted atomically: public name -> active and previous version.

Re-applied when the gateway starts and after every engine restart, so adapters added at
runtime survive both. One manifest per base model, since adapters only fit the base they
were trained on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from loragate.adapters.provenance import RECORD_KEYS, Provenance

log = logging.getLogger("loragate.adapters")


@dataclass(frozen=True)
class ManifestEntry:
    name: str
    active: str
    provenance: Provenance  # where ``active`` came from; follow mode fetches from it again
    previous: str | None = None
    follow: bool = False
    loaded_at: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_record(self) -> dict[str, Any]:
        """The entry as the manifest file holds it: the provenance's keys flat among the rest."""
        return {
            "name": self.name,
            "active": self.active,
            **self.provenance.to_record(),
            "previous": self.previous,
            "follow": self.follow,
            "loaded_at": self.loaded_at,
            "extra": self.extra,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> ManifestEntry:
        """Read what ``to_record`` (or any earlier loragate) wrote; ``ValueError`` if damaged."""
        unknown = set(record) - _FIELDS - set(RECORD_KEYS)
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}")
        own = {key: value for key, value in record.items() if key in _FIELDS}
        return cls(**own, provenance=Provenance.from_record(record))


_FIELDS = {f.name for f in fields(ManifestEntry)} - {"provenance"}


class Manifest:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, ManifestEntry] = {}

    def load(self) -> Manifest:
        """Read the manifest; a damaged one is set aside (kept beside it) and starts empty,
        a damaged entry is skipped, each with a log line: boot never fails on it."""
        if not self.path.is_file():
            return self
        try:
            raw = json.loads(self.path.read_bytes())
            records = raw.get("adapters", {}) if isinstance(raw, dict) else None
            if not isinstance(records, dict):
                raise ValueError("it has no 'adapters' object")
        except (ValueError, OSError) as exc:
            aside = self.path.with_name(f"{self.path.name}.damaged-{int(time.time())}")
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            log.error(
                "the adapter manifest %s is damaged (%s): set aside as %s; starting with no "
                "runtime adapters (add them again, or repair the file and restart)",
                self.path,
                exc,
                aside.name,
            )
            self.entries = {}
            return self
        self.entries = {}
        for name, record in records.items():
            try:
                self.entries[name] = ManifestEntry.from_record(record)
            except (TypeError, ValueError) as exc:
                log.error("adapter manifest %s: skipping entry %r: %s", self.path, name, exc)
        return self

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        payload = {
            "version": 1,
            "adapters": {n: e.to_record() for n, e in sorted(self.entries.items())},
        }
        # Owner-only: sources may carry credentials (signed URLs), needed to fetch again.
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as handle:
            json.dump(payload, handle, indent=2)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o600)  # an older manifest may have left a wider tmp file
        os.replace(tmp, self.path)

    def versions_in_use(self) -> set[str]:
        """Every active and previous version: the store must keep them (rollback needs both)."""
        keep: set[str] = set()
        for entry in self.entries.values():
            keep.add(entry.active)
            if entry.previous:
                keep.add(entry.previous)
        return keep

    def snapshot(self) -> dict[str, ManifestEntry]:
        """A copy of the entries, to compare with later (entries are frozen; ``extra`` is not)."""
        return {name: replace(e, extra=dict(e.extra)) for name, e in self.entries.items()}
