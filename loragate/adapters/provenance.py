"""Where an adapter version came from: one frozen value from the fetch to the manifest and back.

A ``Provenance`` is made once, when the source is fetched (``FetchedSource.provenance``), and
travels unchanged: through the pipeline (``PreparedVersion``), into the version's store
metadata and the manifest entry, and back out of the store metadata on rollback. Follow mode
compares its ``fingerprint`` with the source's current one; the fleet reconciler compares its
``source`` and ``revision`` with the desired state.

On disk it is three flat keys (``source``, ``revision``, ``fingerprint``) inside the manifest
entry and the version's ``.loragate.json``, as every loragate has written them: ``to_record``
and ``from_record`` are the only code that turns it into JSON and back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RECORD_KEYS = ("source", "revision", "fingerprint")


@dataclass(frozen=True)
class Provenance:
    source: str  # the source string as given (may carry credentials: redact before showing)
    revision: str | None = None  # what was fetched: HF commit sha, Tinker path, ETag, ...
    # What source_fingerprint() returned for this source when fetched: follow mode compares.
    fingerprint: str | None = None

    def to_record(self) -> dict[str, str | None]:
        """The JSON keys this provenance is stored under (all three, even when None)."""
        return {"source": self.source, "revision": self.revision, "fingerprint": self.fingerprint}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Provenance:
        """Read the keys ``to_record`` wrote; other keys in ``record`` are the caller's.

        Raises ``ValueError`` when the record names no source.
        """
        if "source" not in record:
            raise ValueError("it names no source")
        return cls(record["source"], record.get("revision"), record.get("fingerprint"))
