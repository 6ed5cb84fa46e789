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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("loragate.adapters")


@dataclass
class ManifestEntry:
    name: str
    active: str
    source: str
    previous: str | None = None
    revision: str | None = None
    follow: bool = False
    fingerprint: str | None = None
    loaded_at: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


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
                self.entries[name] = ManifestEntry(**record)
            except TypeError as exc:
                log.error("adapter manifest %s: skipping entry %r: %s", self.path, name, exc)
        return self

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        payload = {
            "version": 1,
            "adapters": {n: asdict(e) for n, e in sorted(self.entries.items())},
        }
        # Owner-only: sources may carry credentials (signed URLs), needed to fetch again.
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as handle:
            json.dump(payload, handle, indent=2)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o600)  # an older manifest may have left a wider tmp file
        os.replace(tmp, self.path)

    def snapshot(self) -> dict[str, ManifestEntry]:
        return {name: ManifestEntry(**asdict(entry)) for name, entry in self.entries.items()}
