"""The desired adapter state, persisted atomically: public name -> active and previous version.

Re-applied when the gateway starts and after every engine restart, so adapters added at
runtime survive both. One manifest per base model, since adapters only fit the base they
were trained on.

Every entry is checked by type when read (a hand edit, a disk fault or a bug may leave
``"active": 12345``): an entry that does not hold is skipped and kept as it was
(``unreadable``, written back on save so nothing is lost), so one bad entry never stops the
others from loading; the manager reports it as that adapter's failure.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from loragate.adapters.names import validate_adapter_name
from loragate.adapters.provenance import RECORD_KEYS, Provenance
from loragate.adapters.store import write_atomic

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
    # The preset the change gave (the admin API's or a manifest's ``preset``), given again when
    # the source is followed or repaired; None: the source's own ``loragate.json``, if any.
    # The active version's preset itself is stored with it (``StoredAdapter.preset``).
    preset: dict[str, Any] | None = None

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
            # Only when given: an entry without one reads as earlier loragates wrote it.
            **({"preset": self.preset} if self.preset is not None else {}),
        }

    @classmethod
    def from_record(cls, record: Any, name: str | None = None) -> ManifestEntry:
        """Read what ``to_record`` (or any earlier loragate) wrote; ``ValueError`` naming the
        first key that does not hold when damaged. ``name``: the key the entry is filed under,
        which its own ``name`` must repeat."""
        if not isinstance(record, dict):
            raise ValueError("it is not an object")
        unknown = set(record) - _FIELDS - set(RECORD_KEYS)
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}")
        for key, (check, expected) in _CHECKS.items():
            if key in record and not check(record[key]):
                raise ValueError(f"{key!r} must be {expected}, not {record[key]!r:.80}")
        for key in ("name", "active", "source"):
            if key not in record:
                raise ValueError(f"it has no {key!r}")
        validate_adapter_name(record["name"])
        if name is not None and record["name"] != name:
            raise ValueError(f"it is filed under {name!r} but names {record['name']!r}")
        own = {key: value for key, value in record.items() if key in _FIELDS}
        return cls(**own, provenance=Provenance.from_record(record))


_FIELDS = {f.name for f in fields(ManifestEntry)} - {"provenance"}
_DIGEST = re.compile(r"[0-9a-f]{64}")


def _optional_str(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _digest(value: Any) -> bool:
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


def _digest_or_none(value: Any) -> bool:
    return value is None or _digest(value)


def _time_or_none(value: Any) -> bool:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return value is None or (number and math.isfinite(value))


# What each key of a manifest entry must hold (checked on read), and how an error says it.
_CHECKS: dict[str, tuple[Any, str]] = {
    "name": (lambda v: isinstance(v, str), "a string"),
    "active": (_digest, "a version's sha256 (64 hex digits)"),
    "previous": (_digest_or_none, "a version's sha256 (64 hex digits) or null"),
    "source": (lambda v: isinstance(v, str) and bool(v.strip()), "a non-empty string"),
    "revision": (_optional_str, "a string or null"),
    "fingerprint": (_optional_str, "a string or null"),
    "follow": (lambda v: isinstance(v, bool), "true or false"),
    "loaded_at": (_time_or_none, "a time in seconds or null"),
    "extra": (lambda v: isinstance(v, dict), "an object"),
    "preset": (lambda v: v is None or isinstance(v, dict), "an object or null"),
}


def manifest_key(model_dir: Path) -> str:
    """The name (without ``.json``) of the manifest of the base model in ``model_dir``: a hash
    of the directory's path, so two models on one cache dir keep their adapters apart."""
    return hashlib.sha256(str(model_dir).encode()).hexdigest()[:16]


class Manifest:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, ManifestEntry] = {}
        # Entries that could not be read: name -> (why, the record as found). Written back on
        # save until an entry of that name replaces it or it is removed.
        self.unreadable: dict[str, tuple[str, Any]] = {}

    def load(self) -> Manifest:
        """Read the manifest; a damaged one is set aside (kept beside it) and starts empty,
        a damaged entry is skipped, each with a log line: boot never fails on it."""
        self.entries, self.unreadable = {}, {}
        if not self.path.is_file():
            return self
        try:
            raw = json.loads(self.path.read_bytes())
            records = raw.get("adapters", {}) if isinstance(raw, dict) else None
            if not isinstance(records, dict):
                raise ValueError("it has no 'adapters' object")
        except RecursionError:
            return self._set_aside("it is nested too deeply")
        except (ValueError, OSError) as exc:
            return self._set_aside(str(exc))
        for name, record in records.items():
            try:
                self.entries[name] = ManifestEntry.from_record(record, name)
            except (TypeError, ValueError) as exc:
                self.unreadable[name] = (str(exc), record)
                log.error(
                    "adapter manifest %s: skipping entry %r: %s (kept in the file; PUT the "
                    "adapter again or DELETE it)",
                    self.path,
                    name,
                    exc,
                )
        return self

    def _set_aside(self, problem: str) -> Manifest:
        """A manifest that cannot be read at all: kept beside it, and the gateway starts empty."""
        aside = self.path.with_name(f"{self.path.name}.damaged-{int(time.time())}")
        with contextlib.suppress(OSError):
            os.replace(self.path, aside)
        log.error(
            "the adapter manifest %s is damaged (%s): set aside as %s; starting with no "
            "runtime adapters (add them again, or repair the file and restart)",
            self.path,
            problem,
            aside.name,
        )
        return self

    def save(self) -> None:
        """Write the entries (and the unreadable ones, as found) so that a crash or a full
        disk leaves the old file or the new one, whole: ``OSError`` if it could not."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        records = {n: raw for n, (_, raw) in self.unreadable.items() if n not in self.entries}
        records.update((n, e.to_record()) for n, e in self.entries.items())
        payload = {"version": 1, "adapters": dict(sorted(records.items()))}
        # Owner-only: sources may carry credentials (signed URLs), needed to fetch again.
        write_atomic(self.path, json.dumps(payload, indent=2), 0o600)
        for name in set(self.unreadable) & set(self.entries):
            del self.unreadable[name]

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
        return {
            name: replace(e, extra=dict(e.extra), preset=copy.deepcopy(e.preset))
            for name, e in self.entries.items()
        }
