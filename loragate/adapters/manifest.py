"""The desired adapter state, persisted atomically: public name -> active and previous version.

Re-applied when the gateway starts and after every engine restart, so adapters added at
runtime survive both. One manifest per base model, since adapters only fit the base they
were trained on.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


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
        if self.path.is_file():
            raw = json.loads(self.path.read_text())
            self.entries = {
                name: ManifestEntry(**record) for name, record in raw.get("adapters", {}).items()
            }
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
